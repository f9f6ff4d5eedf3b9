"""The ``scale_down`` scenario: the offline pool scaled down under load. Flex load streams on the
offline pool; at the fault a burst of online chats puts online under SLO pressure and the elastic
policy takes the offline replica away (``yield``) while flex streams are open. Serve drains the
replica for its ``graceful_shutdown_timeout_s``; what it has not finished by then the ingress resumes
once the pool is back (online calm, or the offline share after ``offline_max_yield_s``). What must
hold: the pool yielded, every flex answer open then answered in full, none hung, the burst answered
or refused cleanly."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from loadtests.bench.burst import send_chat, wait_until
from loadtests.chaos import procs
from loadtests.chaos.load import start_load
from loadtests.chaos.score import score
from loadtests.summary import read_records

BURST = 16  # concurrent online chats: past the online pool's TTFT SLO on 2 cores
BURST_TOKENS = 128
PROMPT = "Write a long story about a lighthouse keeper and a storm."


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def scale_down(url: str, out: Path, key: str, model: str, rate: float, duration_s: float, inject_s: float) -> dict:
    """Flex-only Locust load at ``rate`` for ``duration_s``; the online burst at ``inject_s``."""
    locust = start_load(url, out, key, rate, duration_s, drain_s=600, flex_share=1.0)  # flex waits for its pool
    time.sleep(inject_s)
    hit, fault_at, t0 = procs.pids("offline"), time.time(), time.monotonic()
    results: list = []
    senders = [threading.Thread(target=send_chat, args=(url, model, PROMPT, "default", BURST_TOKENS, results, key), daemon=True)
               for _ in range(BURST)]
    for sender in senders:
        sender.start()
    yielded_s = wait_until(lambda: not procs.pids("offline"), 180)
    for sender in senders:
        sender.join()
    burst_s = round(time.monotonic() - t0, 1)
    back_s = wait_until(lambda: bool(procs.pids("offline")), 300) if yielded_s is not None else None
    locust.join()
    row = score(read_records(out / "requests.jsonl"), fault_at)
    statuses = [r["status"] for r in results]
    return {**row, "pids_hit": hit, "offline_yielded_s": _round(yielded_s), "burst_s": burst_s,
            "offline_back_after_burst_s": _round(back_s), "burst_sent": BURST, "burst_answered": statuses.count(200),
            "burst_refused_429": statuses.count(429),
            "burst_failed": [r.get("error", r["status"]) for r in results if r["status"] not in (200, 429)]}
