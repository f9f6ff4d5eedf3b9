"""Load tests: stages and tier mix parsing, the summary's arithmetic, and Locust (its own process)
against the stub endpoint: open-loop arrivals that a slow server does not slow, failures counted,
closed loop, and the report files."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from app.cli.serve import free_port
from loadtests.loadtest import ROOT, LoadSpec, _measure, build_workload, get_json
from loadtests.stages import parse_stages, parse_tier_mix
from loadtests.summary import SLO, meets_slo, summarize, tpot_ms


def test_stages_ramp_steady_and_end():
    stages = parse_stages("ramp:10:0-2,steady:5:2,burst:2:6")
    assert stages.total_s == 17
    assert stages.level_at(0) == 0 and stages.level_at(5) == pytest.approx(1.0)
    assert stages.level_at(12) == 2 and stages.level_at(16) == 6 and stages.level_at(17) is None
    assert stages.stage_at(16) == "burst"
    assert stages.mean_level() == pytest.approx((1 * 10 + 2 * 5 + 6 * 2) / 17)
    assert parse_stages(stages.spec()) == stages


@pytest.mark.parametrize("bad", ["steady:10", "steady:x:1", "steady:0:1", "steady:5:-1", ""])
def test_bad_stages_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_stages(bad)


def test_tier_mix():
    assert parse_tier_mix("online=0.7,flex=0.3") == pytest.approx({"online": 0.7, "flex": 0.3})
    assert parse_tier_mix("online=3,flex=1") == pytest.approx({"online": 0.75, "flex": 0.25})
    assert parse_tier_mix("flex=1") == {"online": 0.0, "flex": 1.0}
    for bad in ("batch=1", "online=x", "online=-1", "online=0", "online"):
        with pytest.raises(ValueError):
            parse_tier_mix(bad)


def _record(tier, start, ttft, e2e, tokens, error=None, itl=()):
    return {"tier": tier, "start": start, "ttft_ms": ttft, "e2e_ms": e2e, "output_tokens": tokens, "error": error,
            "itl_ms": list(itl), "status": 200 if error is None else 503}


def test_summary_counts_slo_goodput_and_failures():
    records = [
        _record("online", 100.0, 100, 1100, 11, itl=[100] * 10),   # tpot 100: good
        _record("online", 101.0, 3000, 4000, 11, itl=[100] * 10),  # TTFT over 2000
        _record("online", 102.0, 500, 5500, 11, itl=[500] * 10),   # tpot 500 over 250
        _record("online", 103.0, 200, 200, 1),                     # one token: tpot 0, good
        _record("online", 104.0, None, 10, 0, error="HTTP 503"),   # failure: counted, never good
        _record("flex", 100.0, 1000, 6000, 6, itl=[1000] * 5),     # flex SLO 20000/2500: good
    ]
    slos = {"online": SLO(ttft_ms=2000, tpot_ms=250), "flex": SLO(ttft_ms=20000, tpot_ms=2500)}
    assert tpot_ms(records[0]) == 100 and tpot_ms(records[3]) == 0 and tpot_ms(records[4]) is None
    assert not meets_slo(records[1], slos["online"]) and not meets_slo(records[2], slos["online"])
    summary = summarize(records, slos, {"rate": 1.0})
    wall = (102.0 + 5.5) - 100.0  # first start to last end
    assert summary["duration_s"] == pytest.approx(wall)
    online = summary["tiers"]["online"]
    assert online["requests"] == 5 and online["failures"] == 1
    assert online["slo_attainment"] == pytest.approx(2 / 5)
    assert online["goodput_rps"] == pytest.approx(2 / wall, rel=1e-3)
    assert online["output_tokens_per_s"] == pytest.approx(34 / wall, rel=1e-3)
    assert online["ttft_ms"]["p50"] == pytest.approx(350) and online["ttft_ms"]["mean"] == pytest.approx(950)
    assert online["itl_ms"]["p50"] == 100 and online["e2e_ms"]["mean"] == pytest.approx((1100 + 4000 + 5500 + 200) / 4)
    assert summary["tiers"]["flex"]["slo_attainment"] == 1.0
    assert set(summary) >= {"tiers", "slo", "rate", "duration_s"} and summary["rate"] == 1.0


@pytest.fixture(scope="module")
def stub():
    """loadtests/stub_server.py: 100 ms to the first chunk, then 50 ms a chunk; every 7th request a 503."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtests.stub_server", "--port", str(port), "--ttft-ms", "100",
                             "--itl-ms", "50", "--fail-every", "7"], cwd=ROOT)
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
    # every request ran ~1 s (20 chunks at 50 ms), so several were in flight at once: arrivals kept their times
    starts = sorted(r["start"] for r in records)
    assert starts[-1] - starts[0] < 4.5 and max(r["lag_ms"] for r in records) < 200
    failed = [r for r in records if r["error"]]
    assert all(r["status"] == 503 for r in failed) and len(failed) == n // 7
    ok = [r for r in records if not r["error"]]
    # tokens are exact (ignore_eos convention: the stub sends max_tokens chunks) and ITLs ~ 50 ms
    assert all(r["output_tokens"] == r["max_tokens"] and len(r["itl_ms"]) == r["max_tokens"] - 1 for r in ok)
    tiers = summary["tiers"]
    assert tiers["online"]["requests"] + tiers["flex"]["requests"] == n
    assert tiers["online"]["failures"] + tiers["flex"]["failures"] == len(failed)
    for t in tiers.values():
        if t["requests"] > t["failures"]:
            assert 90 <= t["ttft_ms"]["p50"] < 500 and 45 <= t["itl_ms"]["p50"] < 100 and 45 <= t["tpot_ms"]["p50"] < 100
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
    # two users, each request ~0.3 s (100 ms + 4 x 50 ms): about 2 x 3 / 0.3 = 20, never 2 at a time more
    assert 8 <= len(records) <= 30 and summary["tiers"]["flex"]["requests"] == 0
    assert summary["config"]["mode"] == "closed" and summary["rate"] is None
