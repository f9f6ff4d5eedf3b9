"""The planner on the prepared ShareGPT traces: the plan report's contract, table and plot; the
scheduler A/B command's table and JSON (the same code on synthetic workloads: tests/unit/test_planner.py)."""

from __future__ import annotations

import json

import pytest

from autoscale.planning.planner import PlanRequest

# both draw their workload from the validation trace (Workload.sharegpt); without traces they would
# quietly fall back to a log-normal stand-in, or build the traces on first use
pytestmark = pytest.mark.traces


@pytest.mark.slow
def test_plan_report_contract_table_and_plot(tmp_path, capsys):
    from foreserve.cli.plan import plot_frontier, print_plan
    from autoscale.planning.planner import plan

    req = PlanRequest(model="llama-3-8b", hardware="H100-80G", rate_rps=30, offline_tokens_per_day=1e9,
                      policies=("reserve_predicted", "reserve_max"), tp_options=(1, 2), duration_s=5)
    report = plan(req, progress=False)
    for pool in ("online", "offline"):
        choice = report["pools"][pool]
        assert {"tensor_parallel_size", "replicas", "gpus", "cost_per_million_tokens"} <= set(choice)
        assert choice["policy"] == "reserve_predicted" and set(choice["by_policy"]) == {"reserve_predicted", "reserve_max"}
        assert choice["gpus"] == choice["replicas"] * choice["tensor_parallel_size"] >= 1
    assert len(report["candidates"]) == 4
    assert {p["tensor_parallel_size"] for p in report["frontier"]} == {1, 2}
    print_plan(report)
    assert "reserve_predicted" in capsys.readouterr().out
    plot_frontier(report, str(tmp_path / "frontier.png"))
    assert (tmp_path / "frontier.png").stat().st_size > 10_000


def test_scheduler_ab_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    from foreserve.cli.main import main

    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"fitted": {"memory_bandwidth_bytes_per_s": 3.5e9, "flops": 1.8e10}}))
    out = tmp_path / "ab.json"
    assert main(["plan", "scheduler-ab", "--calibration", str(calibration), "--rates", "0.3", "--duration", "20",
                 "--seeds", "1", "--max-tokens", "128", "--tpot-slo-ms", "300", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "smollm2-135m tp=1 on CPU, KV 8192 tokens, step budget 256" in text and "online vs fcfs: mean E2E" in text
    report = json.loads(out.read_text())
    assert report["schedulers"] == ["online", "fcfs"] and len(report["runs"]) == 2
    assert {"online", "fcfs", "e2e_ratio", "goodput_ratio"} <= report["summary"][0].keys()
    assert "ceiling: 6 answers all queued" in text and report["queued_order_gain"]["gain"] >= 1.0
