"""Steady Locust load for the chaos scenarios (``loadtests/locustfile.py``, streaming, 80% online and
20% flex by default, max_tokens at most 64), in a thread of this process; Locust itself runs as its own process."""

from __future__ import annotations

import threading
from pathlib import Path

from loadtests.loadtest import LoadSpec, build_workload, run_locust
from loadtests.summary import SLO


FLEX_SHARE = 0.2  # of the load sent as service_tier flex, unless told otherwise


def start_load(url: str, out: Path, key: str, rate: float, duration_s: float, cancel_fraction: float = 0.0,
               drain_s: float = 120, flex_share: float = FLEX_SHARE, shapes: tuple[str, ...] = ()) -> threading.Thread:
    """Start ``rate`` req/s for ``duration_s`` (then up to ``drain_s`` for the requests in flight:
    one still open then counts as hung), ``flex_share`` of it flex; each request's record lands in
    ``out/requests.jsonl``. ShareGPT's prompts, or ``shapes`` (PROMPT_TOKENS:OUTPUT_TOKENS, mixed).
    Join the thread to wait for the end."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").unlink(missing_ok=True)
    tiers = {t: w for t, w in (("online", 1 - flex_share), ("flex", flex_share)) if w > 0}
    spec = LoadSpec(stages=f"steady:{duration_s:g}:{rate:g}", tier_mix=tiers, max_tokens=64,
                    slos={"online": SLO(ttft_ms=2000, tpot_ms=250), "flex": SLO(ttft_ms=20000, tpot_ms=2500)},
                    drain_s=drain_s, cancel_fraction=cancel_fraction, shapes=list(shapes))
    build_workload(spec, out / "workload.jsonl")
    locust = threading.Thread(target=run_locust, args=(spec, url, out, out / "workload.jsonl", key), daemon=True)
    locust.start()
    return locust
