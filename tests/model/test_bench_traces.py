"""The throughput benchmark on the prepared ShareGPT traces: JSON contract, useful-token accounting,
the simulated ordering, the quantile sweep; and once with the real model (CLI errors: tests/unit/test_bench.py)."""

from __future__ import annotations

import json

import pytest

from foreserve.cli.main import main
from app.prepare.traces import load_trace
from loadtests.bench.throughput import run_benchmark

CONTRACT_KEYS = {
    "policy", "scheduler", "wall_s", "output_tokens", "output_tokens_per_s", "requests_per_s",
    "mean_running_batch", "peak_kv_used_tokens", "preemptions", "recomputed_tokens",
}
POLICIES = ["reserve_max", "paged", "reserve_predicted", "oracle"]

pytestmark = pytest.mark.traces


def expected_tokens(n: int, max_tokens: int) -> int:
    records = load_trace("validation")
    return sum(min(records[i % len(records)].output_tokens, max_tokens) for i in range(n))


def test_sim_benchmark_contract_and_ordering():
    report = run_benchmark(POLICIES, num_requests=300, kv_tokens=4096, max_tokens=2048,
                           sim="H100-80G:llama-3-70b", tp=2)
    rows = {r["policy"]: r for r in report["results"]}
    assert set(rows) == set(POLICIES)
    total = expected_tokens(300, 2048)
    for row in rows.values():
        assert CONTRACT_KEYS <= set(row)
        assert row["output_tokens"] == total
        assert row["peak_kv_used_tokens"] <= report["config"]["kv_tokens"]
    assert rows["reserve_max"]["preemptions"] == rows["oracle"]["preemptions"] == 0
    # Prediction buys batch size: the whole point.
    assert rows["oracle"]["mean_running_batch"] > 2 * rows["reserve_max"]["mean_running_batch"]
    assert rows["reserve_predicted"]["output_tokens_per_s"] > 2 * rows["reserve_max"]["output_tokens_per_s"]


def test_several_predictors_run_side_by_side():
    report = run_benchmark(["reserve_max", "reserve_predicted"], num_requests=200, kv_tokens=4096, max_tokens=2048,
                           sim="H100-80G:llama-3-70b", tp=2, predictor="oracle,max,oracle:0.5")
    rows = {r["policy"]: r for r in report["results"]}
    assert set(rows) == {"reserve_max", "reserve_predicted", "reserve_predicted@max", "reserve_predicted@oracle:0.5"}
    assert len({r["output_tokens"] for r in rows.values()}) == 1  # same useful tokens everywhere
    # reserve_predicted with no prediction reserves like reserve_max: no batch gain
    assert rows["reserve_predicted"]["mean_running_batch"] > 1.5 * rows["reserve_predicted@max"]["mean_running_batch"]
    assert report["ratios"]["reserve_predicted_vs_reserve_predicted@max"] > 1.5
    assert report["ratios"]["best_policy"] == "reserve_predicted"


def test_step_trace_writes_one_folder_per_row_with_every_step(tmp_path):
    from app.engine.step_trace import read_steps

    report = run_benchmark(["reserve_max", "reserve_predicted"], num_requests=40, kv_tokens=4096, max_tokens=512,
                           sim="H100-80G:llama-3-70b", tp=2, repeats=2, step_trace_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "0-reserve_max", "0-reserve_predicted", "1-reserve_max", "1-reserve_predicted"]
    for row in report["results"]:
        steps = read_steps(sorted((tmp_path / f"0-{row['policy']}").glob("steps-*.jsonl")))
        assert len(steps) == row["steps"]
        # every prompt token once (no preemption here), every output token from one step
        assert row["preemptions"] == 0
        assert sum(s["prefill_tokens"] for s in steps) == sum(r.prompt_tokens for r in load_trace("validation")[:40])
        assert sum(s["decode_rows"] for s in steps) + 40 == row["output_tokens"]


@pytest.mark.model
def test_real_model_benchmark_writes_the_json_contract(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--requests", "3", "--max-tokens", "24", "--kv-tokens", "2048",
               "--policies", ",".join(POLICIES), "--json", str(out), "--step-trace", str(tmp_path / "trace")])
    assert rc == 0
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == sorted(f"0-{p}" for p in POLICIES)
    report = json.loads(out.read_text())
    total = expected_tokens(3, 24)
    for row in report["results"]:
        assert CONTRACT_KEYS <= set(row)
        assert row["output_tokens"] == total
        assert 0 < row["peak_kv_used_tokens"] <= 2048
    assert "reserve_predicted" in capsys.readouterr().out


def test_quantile_sweep_in_modelled_time(tmp_path):
    from scripts.quantile_sweep import main as sweep_main
    from scripts.quantile_sweep import sweep

    rows = sweep([16, 32], "oracle", [0.7])
    assert [(r["requests"], r["predictor"]) for r in rows] == [
        (16, "reserve_max"), (16, "oracle:0.7"), (16, "oracle"), (32, "reserve_max"), (32, "oracle:0.7"), (32, "oracle")]
    by = {(r["requests"], r["predictor"]): r for r in rows}
    assert by[(32, "reserve_max")]["x_reserve_max"] == 1.0
    assert by[(32, "oracle")]["x_reserve_max"] > 1.5 and by[(32, "oracle")]["mean_batch"] > 2 * by[(32, "reserve_max")]["mean_batch"]
    assert by[(32, "oracle")]["steps"] == by[(32, "oracle:0.7")]["steps"]  # exact lengths: no quantile to apply
    sweep_main(["--requests", "8", "--predictor", "oracle", "--quantiles", "0.5", "--json", str(tmp_path / "s.json")])
    assert len(json.loads((tmp_path / "s.json").read_text())["rows"]) == 3
    with pytest.raises(SystemExit):
        sweep_main(["--quantiles", "1.5"])
    with pytest.raises(SystemExit):
        sweep_main(["--predictor", "champion:0.8"])
