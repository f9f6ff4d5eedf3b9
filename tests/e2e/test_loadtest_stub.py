"""Locust (its own process) against loadtests/stub_server.py: open-loop arrivals that a slow server
does not slow, failures counted, the stub's pacing seen in the records, closed loop, the report files.

How fast the generator keeps up (send lag, ITL against the stub's) is a benchmark, not a test:
`foreserve loadtest stub-check` (the first step of `make loadtest-ab`) fails when the p99 send lag
reaches 100 ms or fewer than 80% of the target arrivals are sent."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from app.ports import free_port
from loadtests.loadtest import ROOT, LoadSpec, _measure, build_workload, get_json
from loadtests.summary import SLO

pytestmark = [pytest.mark.locust, pytest.mark.traces]  # the workload is drawn from the prepared traces


STUB_TTFT_MS, STUB_ITL_MS = 100, 50


def max_in_flight(records: list[dict]) -> int:
    """The most requests between their start and their last byte at any one instant."""
    events = sorted([(r["start"], 1) for r in records] + [(r["start"] + r["e2e_ms"] / 1000, -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.fixture(scope="module")
def stub():
    """loadtests/stub_server.py: 100 ms to the first chunk, then 50 ms a chunk; every 7th request a 503."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtests.stub_server", "--port", str(port), "--ttft-ms", str(STUB_TTFT_MS),
                             "--itl-ms", str(STUB_ITL_MS), "--fail-every", "7"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while get_json(f"{url}/health", 2) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)


def _spec(**kw) -> LoadSpec:
    base = dict(stages="steady:4:5", max_tokens=20, tier_mix={"online": 0.5, "flex": 0.5}, drain_s=20,
                slos={"online": SLO(ttft_ms=1000, tpot_ms=100), "flex": SLO(ttft_ms=1000, tpot_ms=100)})
    return LoadSpec(**{**base, **kw})


def test_open_loop_against_the_stub(stub, tmp_path):
    spec = _spec()
    workload = tmp_path / "workload.jsonl"
    build_workload(spec, workload)
    items = [json.loads(line) for line in workload.read_text().splitlines()]
    assert all(1 <= i["max_tokens"] <= 20 for i in items) and {i["tier"] for i in items} == {"online", "flex"}
    assert all(i["prompt"].strip() for i in items)  # blank ShareGPT turns would be 400s, not the service's fault
    summary = _measure(spec, stub, tmp_path, workload, {}, plots=True)
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    n = len(records)
    assert 8 <= n <= 40  # Poisson at 5/s over 4 s
    # open loop: an arrival is sent when it is due, not when an answer comes back, so requests that
    # take the stub up to ~1 s (20 chunks at 50 ms) overlap; a closed loop of one user never would
    assert max_in_flight(records) >= 2
    assert all(r["lag_ms"] is not None for r in records)  # each record says how late it was sent
    failed = [r for r in records if r["error"]]
    assert all(r["status"] == 503 for r in failed) and len(failed) == n // 7
    ok = [r for r in records if not r["error"]]
    # tokens are exact (ignore_eos convention: the stub sends max_tokens chunks), one gap between each two
    assert all(r["output_tokens"] == r["max_tokens"] and len(r["itl_ms"]) == r["max_tokens"] - 1 for r in ok)
    # the stub's pacing is in the records: its sleeps (100 ms, then 50 ms a chunk) are a floor a slow
    # machine can only raise, so the last chunk comes no sooner than they add up to (5% for timer slack)
    assert all(r["ttft_ms"] >= 0.95 * STUB_TTFT_MS for r in ok)
    assert all(r["ttft_ms"] + sum(r["itl_ms"]) >= 0.95 * (STUB_TTFT_MS + STUB_ITL_MS * (r["max_tokens"] - 1)) for r in ok)
    assert all(r["e2e_ms"] >= r["ttft_ms"] + sum(r["itl_ms"]) - 1 for r in ok)  # rounding: 2 decimals a gap
    tiers = summary["tiers"]
    assert tiers["online"]["requests"] + tiers["flex"]["requests"] == n
    assert tiers["online"]["failures"] + tiers["flex"]["failures"] == len(failed)
    for name, t in tiers.items():
        answered = [r for r in ok if r["tier"] == name]
        assert t["requests"] - t["failures"] == len(answered)
        if answered:  # the summary's percentiles are of these records, so they sit above the stub's floor too
            assert t["ttft_ms"]["p50"] >= 0.95 * STUB_TTFT_MS
            assert min(r["ttft_ms"] for r in answered) <= t["ttft_ms"]["p50"] <= max(r["ttft_ms"] for r in answered)
    for name in ("summary.json", "report.html", "latency_cdf.png", "over_time.png", "locust.html", "locust_stats.csv"):
        assert (tmp_path / name).exists(), name
    stats = (tmp_path / "locust_stats.csv").read_text()
    assert "TTFT" in stats and "ITL" in stats and "chat[online]" in stats


def test_closed_loop_users_send_back_to_back(stub, tmp_path):
    spec = _spec(stages="steady:3:2", mode="closed", max_tokens=5, tier_mix={"online": 1.0, "flex": 0.0})
    workload = tmp_path / "workload.jsonl"
    build_workload(spec, workload)
    summary = _measure(spec, stub, tmp_path, workload, {}, plots=False)
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    # two users, each request at least 0.3 s (100 ms + 4 x 50 ms) however fast the machine: never more than
    # two in flight, so at most 2 x (3 / 0.3 + 1) = 22 in the 3 s; each user loops, so more than one each
    assert max_in_flight(records) <= 2
    assert 2 < len(records) <= 30 and summary["tiers"]["flex"]["requests"] == 0
    assert summary["config"]["mode"] == "closed" and summary["rate"] is None


@pytest.mark.model  # the shapes count the embedded model's tokens
def test_fixed_shapes_at_a_constant_rate(stub, tmp_path):
    """``--shape`` prompts of exactly their tokens in the served model's tokenizer, asking for exactly
    their output tokens; ``--arrivals constant`` sends one every 1/rate s: 20 in 4 s at 5/s."""
    from app import paths
    from loadtests.shapes import Tokenizer

    spec = _spec(shapes=["64:6", "200:3"], arrivals="constant", tier_mix={"online": 1.0, "flex": 0.0})
    workload = tmp_path / "workload.jsonl"
    build_workload(spec, workload)
    items = [json.loads(line) for line in workload.read_text().splitlines()]
    tok = Tokenizer.from_pretrained(str(paths.model_dir()))
    assert {i["shape"] for i in items} == {"64:6", "200:3"}
    assert all(len(tok.encode(i["prompt"])) == int(i["shape"].split(":")[0]) for i in items)
    assert all(i["max_tokens"] == int(i["shape"].split(":")[1]) for i in items)
    _measure(spec, stub, tmp_path, workload, {}, plots=False)
    records = sorted((json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()),
                     key=lambda r: r["start"])
    assert len(records) == 20
    gaps = [b["start"] - a["start"] for a, b in zip(records, records[1:])]
    assert all(0.1 < g < 0.3 for g in gaps), gaps  # evenly spaced, 0.2 s apart (send lag aside)
    ok = [r for r in records if not r["error"]]
    assert all(r["output_tokens"] == int(r["shape"].split(":")[1]) for r in ok)
