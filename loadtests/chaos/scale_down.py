"""The ``scale_down`` scenario: the offline pool scaled down under load. Flex load streams on the
offline pool; at the fault online chats, kept open until the pool yields, put online under SLO pressure and the elastic
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

BURST = 24  # online chats kept open at once until the pool yields
BURST_TOKENS = 128
BURST_MAX_S = 150.0  # past this without a yield the row says so (offline_yielded_s null)
# NOTE: long prompts, not short chats: a fast CPU answers two dozen short chats within the TTFT objective
# and never pressures the pool. Prompts of ~1,000 tokens are past what any CPU pool computes as fast as
# they come, so the shedder admits them up to its queue-delay limit and the admitted ones' TTFT p90
# passes the policy's scale_up_slo_ratio of the objective, on a fast machine as on a slow one.
PROMPT = "Summarize the keeper's log below in one paragraph.\n" + "\n".join(
    f"Night {i}: the storm rose again, the lamp held, and the keeper wrote down the ships he saw." for i in range(40))


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def scale_down(url: str, out: Path, key: str, model: str, rate: float, duration_s: float, inject_s: float) -> dict:
    """Flex-only Locust load at ``rate`` for ``duration_s``; the online burst at ``inject_s``."""
    locust = start_load(url, out, key, rate, duration_s, drain_s=600, flex_share=1.0)  # flex waits for its pool
    time.sleep(inject_s)
    hit, fault_at, t0 = procs.pids("offline"), time.time(), time.monotonic()
    results: list = []
    stop = threading.Event()

    def keep_one_open() -> None:  # one chat after another, 2 s after a 429 (send_chat keeps no Retry-After)
        while not stop.is_set():
            mine: list = []
            send_chat(url, model, PROMPT, "default", BURST_TOKENS, mine, key)
            results.extend(mine)
            if mine[0]["status"] == 429:
                stop.wait(2.0)

    senders = [threading.Thread(target=keep_one_open, daemon=True) for _ in range(BURST)]
    for sender in senders:
        sender.start()
    yielded_s = wait_until(lambda: not procs.pids("offline"), BURST_MAX_S)
    stop.set()
    for sender in senders:
        sender.join()
    burst_s = round(time.monotonic() - t0, 1)
    back_s = wait_until(lambda: bool(procs.pids("offline")), 300) if yielded_s is not None else None
    locust.join()
    row = score(read_records(out / "requests.jsonl"), fault_at)
    statuses = [r["status"] for r in results]
    return {**row, "pids_hit": hit, "offline_yielded_s": _round(yielded_s), "burst_s": burst_s,
            "offline_back_after_burst_s": _round(back_s), "burst_sent": len(results), "burst_answered": statuses.count(200),
            "burst_refused_429": statuses.count(429),
            "burst_failed": [r.get("error", r["status"]) for r in results if r["status"] not in (200, 429)]}
