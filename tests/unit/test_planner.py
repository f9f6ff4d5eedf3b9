"""Capacity planner and CPU calibration on the simulator, with synthetic workloads (on the prepared traces:
tests/model/test_planner_traces.py; the simulated day: tests/e2e/test_planner_day.py; the real model's
calibration: tests/model/test_planner_model.py)."""

from __future__ import annotations

import json
import math
import random

import pytest

from app.config import EngineConfig
from app.engine.sim.profiles import HARDWARE, MODELS
from app.engine.sim.runner import SimRunner
from autoscale.planning.calibrate import CPU_OVERHEAD_S, _components, _step_components, calibrate_trace, cpu_model, cpu_profile, fit
from autoscale.planning.capacity import PoolSpec, Workload, offline_throughput, online_capacity, simulate_online
from autoscale.planning.day import diurnal_rates
from autoscale.planning.planner import PlanRequest, _pool_choice, feasible_tps
from autoscale.planning.scheduler_ab import Predictions, queued_order_gain, scheduler_ab

WORKLOAD = Workload.lognormal(400, 111, 330, seed=1)


def test_feasible_tp_degrees_follow_memory():
    assert feasible_tps(PlanRequest(model="llama-3-8b", hardware="H100-80G")) == [1, 2, 4, 8]
    # 141 GB of 70B weights do not fit one 80 GB GPU
    assert feasible_tps(PlanRequest(model="llama-3-70b", hardware="H100-80G")) == [2, 4, 8]
    with pytest.raises(ValueError, match="fits on H100-80G at none"):
        feasible_tps(PlanRequest(model="llama-3-70b", hardware="H100-80G", tp_options=(1,)))


def test_pool_choice_picks_fewest_gpus_and_prices_them():
    rows = [
        {"tensor_parallel_size": 1, "policy": "reserve_predicted", "online_capacity_rps": 10.0,
         "offline_tokens_per_s": 1000.0, "mean_output_tokens": 300.0},
        {"tensor_parallel_size": 2, "policy": "reserve_predicted", "online_capacity_rps": 25.0,
         "offline_tokens_per_s": 2500.0, "mean_output_tokens": 300.0},
        {"tensor_parallel_size": 1, "policy": "reserve_max", "online_capacity_rps": 4.0,
         "offline_tokens_per_s": 500.0, "mean_output_tokens": 300.0},
    ]
    req = PlanRequest(rate_rps=40, target_utilization=1.0, offline_tokens_per_day=1000 * 86400 * 3, gpu_hour_usd=2.0,
                      policies=("reserve_predicted", "reserve_max"))
    online = _pool_choice(rows, "online", req)
    # tp1: 4 replicas = 4 GPUs; tp2: 2 replicas = 4 GPUs -> tie, the smaller TP wins
    assert (online["tensor_parallel_size"], online["replicas"], online["gpus"]) == (1, 4, 4)
    assert online["by_policy"]["reserve_max"]["gpus"] == 10
    tokens_per_hour = 40 * 300 * 3600
    assert online["cost_per_million_tokens"] == pytest.approx(4 * 2.0 / tokens_per_hour * 1e6, rel=1e-3)
    offline = _pool_choice(rows, "offline", req)
    assert (offline["replicas"], offline["gpus"]) == (3, 3)  # tp1 3 GPUs beats tp2 (2 replicas = 4 GPUs)


def test_simulated_replica_meets_slo_at_its_capacity_and_not_beyond():
    spec = PoolSpec(HARDWARE["H100-80G"], MODELS["llama-3-8b"], 1)
    rps, run, tokens_per_s = online_capacity(spec, WORKLOAD, ttft_slo_ms=200, tpot_slo_ms=50, duration_s=8, iterations=4)
    assert 0 < rps <= tokens_per_s / WORKLOAD.mean_output_tokens
    assert run.ttft_p99_ms <= 200 and run.tpot_p99_ms <= 50
    over = simulate_online(spec, tokens_per_s / WORKLOAD.mean_output_tokens * 1.5, WORKLOAD, duration_s=8)
    assert over.ttft_p99_ms > 200  # 1.5x the offline packing rate: the queue grows
    # an impossible TPOT (below one batch-1 decode step, ~6 ms) gives no capacity at all
    assert online_capacity(spec, WORKLOAD, ttft_slo_ms=1000, tpot_slo_ms=1, duration_s=5, iterations=2)[0] == 0


def test_reserve_predicted_packs_more_than_reserve_max_when_memory_binds():
    """70B at tp=2 on an H100 has ~10 GB of KV room per GPU: predicted reservations fit more sequences."""
    base = (HARDWARE["H100-80G"], MODELS["llama-3-70b"], 2)
    predicted = offline_throughput(PoolSpec(*base, "reserve_predicted"), WORKLOAD, 300)
    maximal = offline_throughput(PoolSpec(*base, "reserve_max"), WORKLOAD, 300)
    assert predicted > 1.5 * maximal


def test_diurnal_rates_span_trough_to_peak():
    rates = diurnal_rates(100, trough_frac=0.2)
    assert len(rates) == 1440 and rates.max() == pytest.approx(100) and rates.min() == pytest.approx(20, rel=1e-3)
    assert int(rates.argmax()) == 14 * 60


def test_calibration_fit_recovers_known_constants():
    bw, flops = 6e9, 3e10
    points = []
    for b in (1, 4, 16, 64):
        mem, cmp = _components(b, 256)
        points.append((b, max(mem / bw, cmp / flops) + CPU_OVERHEAD_S))
    got_bw, got_flops, worst = fit(points, 256)
    assert worst < 0.03
    assert math.isclose(got_bw, bw, rel_tol=0.05) and math.isclose(got_flops, flops, rel_tol=0.1)


def test_trace_calibration_recovers_known_constants(tmp_path):
    bw, flops = 5e9, 4e10
    rng = random.Random(0)
    lines = []
    for i in range(60):
        decode = [[rng.randint(50, 900), 1, 1] for _ in range(rng.choice([1, 2, 4, 8, 16, 32]))]
        prefill = [[0, rng.randint(16, 200), 1]] if i % 3 == 0 else []
        chunks = decode + prefill
        mem, cmp = _step_components([tuple(c) for c in chunks])
        t = max(mem / bw, cmp / flops) + CPU_OVERHEAD_S
        if i % 10 == 0:
            t *= 3  # a step that shared the cores: the median fit must shrug it off
        lines.append(json.dumps({"forward_s": t, "decode_rows": len(decode), "prefill_tokens": sum(c[1] for c in prefill),
                                 "chunks": chunks}))
    path = tmp_path / "steps-online-1.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = calibrate_trace([path])
    assert report["steps"] == 60 and report["median_abs_error"] < 0.03
    fitted = report["fitted"]
    assert math.isclose(fitted["memory_bandwidth_bytes_per_s"], bw, rel_tol=0.05)
    assert math.isclose(fitted["flops"], flops, rel_tol=0.1)
    assert {row["decode_rows"] for row in report["decode_steps"]} >= {"1-1", "16-31"}
    with pytest.raises(ValueError, match="no traced steps"):
        (tmp_path / "empty.jsonl").write_text("")
        calibrate_trace([tmp_path / "empty.jsonl"])
    (tmp_path / "torn.jsonl").write_text(lines[0] + "\n" + lines[1][:20] + "\n")
    with pytest.raises(ValueError, match=r"torn.jsonl:2: not a step-trace line"):
        calibrate_trace([tmp_path / "torn.jsonl"])


def _cpu_ab_config(**overrides) -> tuple[SimRunner, EngineConfig]:
    runner = SimRunner(cpu_profile(3.5e9, 1.8e10), cpu_model())
    fields = dict(allocation="reserve_predicted", kv_cache_tokens=8192, max_num_batched_tokens=256, max_num_seqs=256,
                  default_max_tokens=256, max_model_len_tokens=2304, ttft_slo_ms=2000, tpot_slo_ms=300)
    fields.update(overrides)
    return runner, EngineConfig(**fields)


def test_scheduler_ab_gives_both_schedulers_the_same_load():
    runner, config = _cpu_ab_config()
    workload = Workload.lognormal(300, 111, 150, max_tokens=256, seed=2)
    report = scheduler_ab(runner, config, workload, rates=[0.3], duration_s=40, seeds=2, schedulers=("fcfs", "fcfs"))
    [row] = report["summary"]
    assert row["e2e_ratio"] == 1.0 and row["goodput_ratio"] in (1.0, None)  # deterministic: same arrivals, same result
    runs = report["runs"]
    assert len(runs) == 4 and runs[0] == runs[1] and runs[0]["requests"] > 0
    for run in runs:
        assert 0 <= run["slo_attainment"] <= 1 and run["mean_e2e_s"] > 0 and run["output_tokens_per_s"] > 0
        assert run["goodput_rps"] == pytest.approx(run["slo_attainment"] * run["requests"] / 40, abs=1e-3)


def test_scheduler_ab_online_beats_fcfs_in_overload():
    """Past saturation FCFS admits everything memory allows and every answer slows; the online
    scheduler holds the decode batch to the TPOT objective and runs predicted-short answers first."""
    runner, config = _cpu_ab_config()
    workload = Workload.lognormal(300, 111, 150, max_tokens=256, seed=2)
    report = scheduler_ab(runner, config, workload, rates=[0.8], duration_s=40, seeds=1)
    [row] = report["summary"]
    assert row["e2e_ratio"] > 1.1
    assert row["online"]["p50_tpot_ms"] < row["fcfs"]["p50_tpot_ms"]


def test_scheduler_ab_orders_by_the_given_ranking_estimate():
    """A predictor whose bounds all say max_tokens ranks nothing by its bound; its ranking estimate
    (here exact) lets the online scheduler run short answers first."""
    runner, config = _cpu_ab_config(tpot_slowdown=None, knee_throughput_fraction=1.0)  # steps filled to the TPOT objective
    workload = Workload.lognormal(300, 111, 150, max_tokens=256, seed=2)
    flat = Predictions([9] * 300, [256] * 300, [float(t) for t in workload.output_tokens], "test")
    by_rank, by_bound = (scheduler_ab(runner, config, workload, rates=[0.8], duration_s=40, seeds=1, predictions=flat,
                                      order_by=o) for o in ("rank", "bound"))
    assert by_rank["predictor"] == "test" and by_rank["order_by"] == "rank" and by_bound["order_by"] == "bound"
    assert by_rank["summary"][0]["online"]["mean_e2e_s"] < 0.97 * by_bound["summary"][0]["online"]["mean_e2e_s"]
    fcfs = [r for r in by_rank["runs"] if r["scheduler"] == "fcfs"]
    assert fcfs == [r for r in by_bound["runs"] if r["scheduler"] == "fcfs"]  # FCFS reads neither
    with pytest.raises(ValueError, match="order_by"):
        scheduler_ab(runner, config, workload, rates=[0.8], duration_s=5, seeds=1, order_by="score")


def test_queued_order_gain():
    assert queued_order_gain([100], requests=20, slots=3) == 1.0  # equal lengths: order is moot
    # one slot, two draws from {1, 9}: only the draw (9, 1) is out of order, and it completes at
    # 9, 10 (mean 9.5) against 1, 10 (5.5) sorted; the other three draws gain nothing
    gain = queued_order_gain([1, 9], requests=2, slots=1, trials=400)
    assert gain == pytest.approx(0.75 + 0.25 * 9.5 / 5.5, abs=0.05)
    assert queued_order_gain([1, 9], requests=2, slots=2) == 1.0  # a slot each: nobody waits
    with pytest.raises(ValueError):
        queued_order_gain([1], requests=0, slots=1)


def test_scheduler_ab_rejects_bad_input_clearly(tmp_path, capsys):
    from foreserve.cli.main import main

    runner, config = _cpu_ab_config()
    workload = Workload.lognormal(50, 111, 150, max_tokens=256, seed=2)
    with pytest.raises(ValueError, match="rates > 0"):
        scheduler_ab(runner, config, workload, rates=[0.0], duration_s=40)
    with pytest.raises(ValueError, match="seeds >= 1"):
        scheduler_ab(runner, config, workload, rates=[0.3], duration_s=40, seeds=0)
    with pytest.raises(ValueError, match="two schedulers"):
        scheduler_ab(runner, config, workload, rates=[0.3], duration_s=40, schedulers=("online",))
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"points": []}))
    assert main(["plan", "scheduler-ab", "--calibration", str(bad), "--rates", "0.3"]) == 2
    assert "not `plan calibrate-cpu --json` output" in capsys.readouterr().err


def test_scheduler_ab_takes_engine_settings_after_the_scheduler_name():
    from autoscale.planning.scheduler_ab import scheduler_config

    _, config = _cpu_ab_config()
    tuned = scheduler_config(config, "online:tpot_target_ms=150:knee_throughput_fraction=1")
    assert (tuned.scheduler, tuned.tpot_target_ms, tuned.knee_throughput_fraction) == ("online", 150.0, 1.0)
    knee = scheduler_config(config, "online:tpot_slowdown=null")
    assert (config.tpot_slowdown, knee.tpot_slowdown) == (3.5, None)
    assert scheduler_config(config, "fcfs").scheduler == "fcfs"
    with pytest.raises(ValueError, match="field=value"):
        scheduler_config(config, "online:tpot=150")


def test_measured_runner_times_steps_as_the_trace_did(tmp_path):
    from app.engine.outputs import ScheduledChunk, SchedulerOutput
    from app.engine.request import SamplingParams
    from app.engine.sim.measured import MeasuredRunner, read_step_trace

    trace = tmp_path / "steps.jsonl"
    steps = [(1, 0, 0.04), (8, 0, 0.10), (0, 64, 0.30)] * 3 + [(16, 0, 9.9)]  # one step of 16 rows: too few to time
    trace.write_text("".join(json.dumps({"decode_rows": d, "prefill_tokens": p, "forward_s": s}) + "\n" for d, p, s in steps))
    runner = MeasuredRunner(_cpu_ab_config()[0], *read_step_trace([trace]))
    greedy = SamplingParams(temperature=0.0)

    def step_s(*chunks):
        return runner.execute(SchedulerOutput([ScheduledChunk(f"r{i}", [1] * n, 100, [0], sample, greedy, 0)
                                               for i, (n, sample) in enumerate(chunks)])).step_s

    assert step_s((1, True)) == pytest.approx(0.04)
    assert step_s(*[(1, True)] * 4) == pytest.approx(0.04 + 0.06 * 3 / 7)  # between the 1- and 8-row medians
    assert step_s(*[(1, True)] * 16) == pytest.approx(0.20)  # past 8 rows: proportional, not the lone 9.9 s step
    assert step_s((32, False)) == pytest.approx(0.30) and step_s((128, True)) == pytest.approx(0.60)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no bin"):
        read_step_trace([empty])
