"""``foreserve loadtest peer``'s own logic (loadtests/peer.py): the variants' configs, the medians and
the online targets against llama-server. Running it needs `make llama-cpp`, which `make test` never builds."""

from __future__ import annotations

import pytest
import yaml


def _figures(**kw) -> dict:
    base = {"requests": 51, "failures": 0, "ttft_p50_ms": 400.0, "ttft_p90_ms": 1000.0, "tpot_p50_ms": 100.0,
            "tpot_p90_ms": 120.0, "mean_e2e_ms": 20000.0, "slo_attainment": 0.9, "good_per_window_rps": 0.5,
            "goodput_rps": 0.5, "output_tokens_per_s": 100.0}
    return {**base, **kw}


def test_a_variant_sets_the_online_pools_step_policy_and_the_tests_slos(tmp_path):
    from app.config import DEFAULT_CONFIG_PATH, AppConfig
    from loadtests.loadtest import LoadSpec
    from loadtests.peer import variant_config, variant_name
    from loadtests.summary import SLO

    spec = LoadSpec(stages="steady:60:1", slos={"online": SLO(ttft_ms=1500, tpot_ms=200), "flex": SLO(ttft_ms=1e4, tpot_ms=1e3)})
    specs = ["default", "knee", "knee:0.7", "slowdown:3", "100"]
    configs = [yaml.safe_load(variant_config(DEFAULT_CONFIG_PATH, tmp_path / f"{i}.yaml", t, spec).read_text())
               for i, t in enumerate(specs)]
    online = [c["applications"][0]["args"]["pools"]["online"] for c in configs]
    assert all((o["ttft_slo_ms"], o["tpot_slo_ms"]) == (1500, 200) for o in online)
    policies = [AppConfig.model_validate(c["applications"][0]["args"]).pools["online"] for c in configs]
    assert [(p.tpot_target_ms, p.tpot_slowdown, p.knee_throughput_fraction) for p in policies] == [
        (None, 3.5, 0.9), (None, None, 0.9), (None, None, 0.7), (None, 3.0, 0.9), (100.0, 3.5, 0.9)]
    assert [variant_name(t) for t in specs] == [
        "foreserve", "foreserve knee", "foreserve knee 0.7", "foreserve slowdown 3", "foreserve tpot 100 ms"]
    # nothing else of the service changes: autoscaling stays as configured
    assert all("autoscaling_policy" in c["applications"][0] for c in configs)
    assert len({o["torch_threads"] for o in online}) == 1  # the config's thread count


def test_a_thread_variant_sets_the_online_pools_torch_threads_alone(tmp_path):
    from app.config import DEFAULT_CONFIG_PATH
    from loadtests.loadtest import LoadSpec
    from loadtests.peer import variant_config, variant_name
    from loadtests.summary import SLO

    spec = LoadSpec(stages="steady:60:1", slos={"online": SLO(ttft_ms=2000, tpot_ms=250), "flex": SLO(ttft_ms=2e4, tpot_ms=2500)})
    data = yaml.safe_load(variant_config(DEFAULT_CONFIG_PATH, tmp_path / "c.yaml", "default", spec, 2).read_text())
    pools = data["applications"][0]["args"]["pools"]
    source = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())["applications"][0]["args"]["pools"]
    assert pools["online"]["torch_threads"] == 2 and "tpot_target_ms" not in pools["online"]
    assert pools["offline"] == source["offline"]
    assert [variant_name("default", 1), variant_name("60", 2)] == ["foreserve 1 thread", "foreserve tpot 60 ms 2 threads"]


def test_medians_skip_a_figure_a_run_lacks():
    from loadtests.summary import medians

    runs = [_figures(tpot_p50_ms=90.0), _figures(tpot_p50_ms=110.0, mean_e2e_ms=None), _figures(tpot_p50_ms=200.0)]
    med = medians(runs)
    assert med["tpot_p50_ms"] == 110.0
    assert med["mean_e2e_ms"] == 20000.0  # of the two runs that had one
    assert medians([_figures(mean_e2e_ms=None)])["mean_e2e_ms"] is None


def test_the_online_targets_are_lower_latency_and_one_and_a_half_times_the_goodput():
    from loadtests.peer import verdicts

    peer = _figures(tpot_p50_ms=101.0, mean_e2e_ms=50000.0, good_per_window_rps=0.1, ttft_p90_ms=60000.0)
    ours = _figures(tpot_p50_ms=160.0, mean_e2e_ms=30000.0, good_per_window_rps=0.14, ttft_p90_ms=60000.0)
    got = {v["metric"]: (v["ratio"], v["met"]) for v in verdicts(ours, peer)}
    assert got == {"tpot_p50_ms": (1.584, False), "mean_e2e_ms": (0.6, True),
                   "good_per_window_rps": (1.4, False),  # 1.4x: short of 1.5x
                   "ttft_p90_ms": (1.0, True)}  # level counts as met
    missing = {v["metric"]: v["met"] for v in verdicts(_figures(tpot_p50_ms=None), peer)}
    assert missing["tpot_p50_ms"] is False


def test_no_goodput_on_either_side_is_no_win_and_any_against_none_is():
    from loadtests.peer import verdicts

    nothing = _figures(good_per_window_rps=0.0)
    both = {v["metric"]: (v["ratio"], v["met"]) for v in verdicts(nothing, nothing)}
    assert both["good_per_window_rps"] == (None, False)
    some = {v["metric"]: (v["ratio"], v["met"]) for v in verdicts(_figures(good_per_window_rps=0.2), nothing)}
    assert some["good_per_window_rps"] == (float("inf"), True)


def test_goodput_is_counted_per_second_of_arrivals_not_to_the_last_answer():
    from loadtests.summary import key_figures

    tier = {"requests": 50, "failures": 5, "ttft_ms": {"p50": 1, "p90": 2}, "tpot_ms": {"p50": 3, "p90": 4},
            "e2e_ms": {"mean": 5}, "slo_attainment": 0.4, "goodput_rps": 0.1, "output_tokens_per_s": 6}
    # 20 of 50 within the SLOs over a 40 s arrival window, whatever the last answer's time (200 s here)
    summary = {"tiers": {"online": tier}, "duration_s": 200.0, "config": {"arrival_window_s": 40.0}}
    assert key_figures(summary)["good_per_window_rps"] == 0.5


def test_a_run_into_a_used_report_dir_counts_only_its_own_requests(tmp_path, monkeypatch):
    import json

    from loadtests import loadtest, peer
    from loadtests.summary import SLO

    out = tmp_path / "run_0"
    out.mkdir()
    old = {"tier": "online", "start": 0.0, "status": 200, "error": None, "ttft_ms": 10.0, "e2e_ms": 100.0, "output_tokens": 10}
    (out / "requests.jsonl").write_text(json.dumps(old) + "\n")  # an earlier sweep's record

    def fake_locust(spec, host, report, workload, api_key=""):
        new = {**old, "start": 1.0, "status": 429, "error": "HTTP 429"}
        with (report / "requests.jsonl").open("a") as f:  # the locustfile appends
            f.write(json.dumps(new) + "\n")
        return 0

    monkeypatch.setattr(loadtest, "run_locust", fake_locust)
    monkeypatch.setattr(loadtest, "build_workload", lambda spec, path: 0)
    monkeypatch.setattr(loadtest, "HealthPoller", type("P", (), {"__init__": lambda *a: None, "start": lambda s: None,
                                                                "stop": lambda s: None}))
    spec = loadtest.LoadSpec(stages="steady:10:1", slos={"online": SLO(ttft_ms=2000, tpot_ms=250),
                                                         "flex": SLO(ttft_ms=2e4, tpot_ms=2500)})
    figures = peer._run(spec, "http://127.0.0.1:1", out, 1.0, 10, {})
    assert (figures["requests"], figures["failures"]) == (1, 1)


def test_peer_json_keeps_what_a_sweep_cut_short_measured():
    from loadtests.peer import LLAMA, summarize_runs

    runs = {LLAMA: {1.0: [_figures()], 1.5: []}, "foreserve": {1.0: [], 1.5: []}}
    meta = {"systems": [LLAMA, "foreserve"], "rates": [1.0, 1.5]}
    result = summarize_runs(runs, meta)
    assert [sorted(row["medians"]) for row in result["by_rate"]] == [[LLAMA], []]
    assert all(row["targets"] == {} for row in result["by_rate"])


@pytest.mark.parametrize("bad", ["fast", "-5", "0", "inf", "slow:2", "knee:"])
def test_a_step_policy_it_does_not_know_is_refused_before_anything_starts(bad, capsys):
    from foreserve.cli.main import main

    assert main(["loadtest", "peer", "--tpot-targets", f"default,{bad}", "--report", "/nonexistent/peer"]) == 2
    assert f"{bad!r} is none of `default`, `knee`, `knee:FRACTION`, `slowdown:K` or a step time in ms" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [
    ("knee:0", "a knee's throughput fraction is above 0 and at most 1"),
    ("knee:1.5", "a knee's throughput fraction is above 0 and at most 1"),
    ("knee:x", "a knee's throughput fraction is above 0 and at most 1"),
    ("slowdown:0.5", "a slowdown is at least 1"),
    ("slowdown:x", "a slowdown is at least 1"),
])
def test_a_knee_fraction_or_slowdown_out_of_range_is_refused_before_anything_starts(bad, message, capsys):
    from foreserve.cli.main import main

    assert main(["loadtest", "peer", "--tpot-targets", bad, "--report", "/nonexistent/peer"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--slots", "0"], "--slots and --ctx-tokens must be >= 1"),
    (["--rates", "1,0"], "--rates must be distinct rates above 0"),
    (["--rates", "1,1"], "--rates must be distinct rates above 0"),
    (["--tpot-targets", "default,default"], "names a variant twice"),
    (["--online-threads", "1,1"], "--online-threads must be distinct counts >= 1"),
    (["--online-threads", "0,2"], "--online-threads must be distinct counts >= 1"),
    (["--tier-mix", "flex=1"], "give --tier-mix an online share"),
])
def test_bad_sweeps_are_refused_before_anything_starts(args, message, capsys):
    from foreserve.cli.main import main

    assert main(["loadtest", "peer", *args, "--report", "/nonexistent/peer"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option, value, message", [
    ("--online-threads", "a,2", "--online-threads: comma-separated thread counts, e.g. 1,2; got 'a,2'"),
    ("--rates", "x,1", "--rates: comma-separated request rates, e.g. 1,1.5; got 'x,1'"),
])
def test_a_list_value_that_is_not_a_number_is_named_in_the_error(option, value, message, capsys):
    from foreserve.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["loadtest", "peer", option, value, "--report", "/nonexistent/peer"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
