"""``foreserve loadtest peer``'s own logic (loadtests/peer.py): the variants' configs, the medians and
the online targets against llama-server. Running it needs `make llama-cpp`, which `make test` never builds."""

from __future__ import annotations

import pytest
import yaml


def _figures(**kw) -> dict:
    base = {"requests": 51, "failures": 0, "ttft_p50_ms": 400.0, "ttft_p90_ms": 1000.0, "tpot_p50_ms": 100.0,
            "tpot_p90_ms": 120.0, "mean_e2e_ms": 20000.0, "slo_attainment": 0.9, "goodput_rps": 0.5,
            "output_tokens_per_s": 100.0}
    return {**base, **kw}


def test_a_variant_sets_the_online_pools_step_target_and_the_tests_slos(tmp_path):
    from app.config import DEFAULT_CONFIG_PATH
    from loadtests.loadtest import LoadSpec
    from loadtests.peer import variant_config, variant_name
    from loadtests.summary import SLO

    spec = LoadSpec(stages="steady:60:1", slos={"online": SLO(ttft_ms=1500, tpot_ms=200), "flex": SLO(ttft_ms=1e4, tpot_ms=1e3)})
    knee = yaml.safe_load(variant_config(DEFAULT_CONFIG_PATH, tmp_path / "a.yaml", "knee", spec).read_text())
    tight = yaml.safe_load(variant_config(DEFAULT_CONFIG_PATH, tmp_path / "b.yaml", "100", spec).read_text())
    online = [c["applications"][0]["args"]["pools"]["online"] for c in (knee, tight)]
    assert [(o["ttft_slo_ms"], o["tpot_slo_ms"]) for o in online] == [(1500, 200), (1500, 200)]
    assert "tpot_target_ms" not in online[0] and online[1]["tpot_target_ms"] == 100.0
    assert [variant_name("knee"), variant_name("100")] == ["foreserve", "foreserve tpot 100 ms"]
    # nothing else of the service changes: autoscaling stays as configured
    assert "autoscaling_policy" in tight["applications"][0]


def test_medians_skip_a_figure_a_run_lacks():
    from loadtests.peer import medians

    runs = [_figures(tpot_p50_ms=90.0), _figures(tpot_p50_ms=110.0, mean_e2e_ms=None), _figures(tpot_p50_ms=200.0)]
    med = medians(runs)
    assert med["tpot_p50_ms"] == 110.0
    assert med["mean_e2e_ms"] == 20000.0  # of the two runs that had one
    assert medians([_figures(mean_e2e_ms=None)])["mean_e2e_ms"] is None


def test_the_online_targets_are_lower_latency_and_one_and_a_half_times_the_goodput():
    from loadtests.peer import verdicts

    peer = _figures(tpot_p50_ms=101.0, mean_e2e_ms=50000.0, goodput_rps=0.1, ttft_p90_ms=60000.0)
    ours = _figures(tpot_p50_ms=160.0, mean_e2e_ms=30000.0, goodput_rps=0.14, ttft_p90_ms=60000.0)
    got = {v["metric"]: (v["ratio"], v["met"]) for v in verdicts(ours, peer)}
    assert got == {"tpot_p50_ms": (1.584, False), "mean_e2e_ms": (0.6, True),
                   "goodput_rps": (1.4, False),  # 1.4x: short of 1.5x
                   "ttft_p90_ms": (1.0, True)}  # level counts as met
    missing = {v["metric"]: v["met"] for v in verdicts(_figures(tpot_p50_ms=None), peer)}
    assert missing["tpot_p50_ms"] is False


@pytest.mark.parametrize("bad", ["fast", "-5", "0"])
def test_a_step_target_that_is_not_a_time_is_refused_before_anything_starts(bad, capsys):
    from foreserve.cli.main import main

    assert main(["loadtest", "peer", "--tpot-targets", f"knee,{bad}", "--report", "/nonexistent/peer"]) == 2
    assert f"{bad!r} is neither `knee` nor a step time in ms" in capsys.readouterr().err


def test_llama_servers_slots_and_cache_must_be_positive(capsys):
    from foreserve.cli.main import main

    assert main(["loadtest", "peer", "--slots", "0", "--report", "/nonexistent/peer"]) == 2
    assert "--slots and --ctx-tokens must be >= 1" in capsys.readouterr().err
