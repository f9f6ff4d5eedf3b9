"""Load tests without a load: stages and tier mix parsing, the summary's arithmetic (Locust against
the stub endpoint: tests/e2e/test_loadtest_stub.py)."""

from __future__ import annotations

import pytest

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
