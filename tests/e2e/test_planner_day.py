"""The simulated day: the elastic fleet against a static one sized for the peak, driven by the real
policy inside Ray Serve's app-level autoscaling wrapper (imported, not started)."""

from __future__ import annotations

import pytest

from autoscale.planning.day import LOADS, simulate_day

pytestmark = pytest.mark.ray  # simulate_day runs the policy through Serve's autoscaling classes; starts nothing


def _synthetic_replica(capacity: float = 10.0) -> dict:
    # flat latency up to capacity, then the queue's cliff; batch grows with load
    return {"capacity_rps": capacity, "ttft_p99_ms": [50, 55, 60, 70, 80, 100, 900, 5000],
            "kv_util": [0.05 * x for x in LOADS], "running_batch": [100 * x for x in LOADS],
            "tensor_parallel_size": 2, "offline_tokens_per_s": 10000.0, "mean_output_tokens": 300.0}


def test_simulated_day_elastic_beats_static_peak():
    # GPU-fleet thresholds (big pools: a replica less changes occupancy by little)
    report = simulate_day(_synthetic_replica(), peak_rps=100, offline_tokens_per_day=10000 * 86400 * 2,
                          ttft_slo_ms=1000, tpot_slo_ms=50, policy_kwargs={"scale_up_occupancy": 0.95, "calm_occupancy": 0.8})
    elastic, static = report["elastic"], report["static_peak"]
    assert (static["online_replicas"], static["offline_replicas"]) == (10, 2)
    assert static["gpu_hours"] == 12 * 24 * 2
    assert elastic["online_minutes_within_slo_frac"] >= 0.99
    assert elastic["offline_tokens"] >= static["offline_tokens"] * 0.999  # the same offline work
    assert elastic["gpu_hours"] <= 0.8 * static["gpu_hours"]
    assert max(s[2] + s[3] for s in report["series"]) <= elastic["replica_budget"]  # budget respected


def _books_balance(fleet: dict) -> None:
    # tokens are conserved over the counted day: the backlog grew by what arrived and was not done
    assert fleet["offline_backlog_end_tokens"] - fleet["offline_backlog_start_tokens"] == pytest.approx(
        fleet["offline_arrived_tokens"] - fleet["offline_tokens"], abs=2)


def test_simulated_day_books_balance_and_count_the_same_work():
    report = simulate_day(_synthetic_replica(), peak_rps=100, offline_tokens_per_day=10000 * 86400 * 2,
                          ttft_slo_ms=1000, tpot_slo_ms=50, policy_kwargs={"scale_up_occupancy": 0.95, "calm_occupancy": 0.8})
    for fleet in (report["elastic"], report["static_peak"]):
        assert fleet["offline_arrived_tokens"] == 10000 * 86400 * 2
        _books_balance(fleet)
        assert fleet["kept_up"]
    assert report["static_peak"]["offline_backlog_end_tokens"] == 0  # sized for the day: never behind
    assert report["same_work"]


# one llama-3-8b replica on an H100-80G as `foreserve plan simulate-day --model llama-3-8b --hardware H100-80G`
# simulates it (replica_model's output, embedded so the test runs in seconds)
LLAMA_3_8B_H100 = {
    "capacity_rps": 57.924655719580905, "tensor_parallel_size": 1, "offline_tokens_per_s": 19306.75599895582,
    "mean_output_tokens": 323.413,
    "ttft_p99_ms": [31.13, 27.92, 33.89, 59.41, 71.29, 62.25, 83.63, 204.86],
    "kv_util": [0.0110, 0.0236, 0.0399, 0.0553, 0.0648, 0.0727, 0.0805, 0.0929],
    "running_batch": [14.67, 31.00, 52.55, 72.71, 86.27, 98.13, 107.46, 123.94],
}


def test_simulated_day_llama_3_8b_saves_a_fifth_on_the_same_work():
    report = simulate_day(LLAMA_3_8B_H100, peak_rps=200, offline_tokens_per_day=3e9, ttft_slo_ms=1000, tpot_slo_ms=50)
    elastic, static = report["elastic"], report["static_peak"]
    assert report["gpu_hours_saved_frac"] >= 0.20
    assert elastic["online_minutes_within_slo_frac"] == 1.0
    for fleet in (elastic, static):
        _books_balance(fleet)
        assert fleet["offline_tokens"] == pytest.approx(3e9, rel=0.005)  # the day's work, not a warm-up day's backlog
    assert report["same_work"]


def test_simulated_day_without_share_falls_behind_and_claims_no_saving():
    # share gives starved offline work a replica back after offline_max_yield_s; without it offline waits
    # for online to leave room, and on this day that is too little
    report = simulate_day(LLAMA_3_8B_H100, peak_rps=200, offline_tokens_per_day=3e9, ttft_slo_ms=1000, tpot_slo_ms=50,
                          policy_kwargs={"offline_max_yield_s": None})
    elastic = report["elastic"]
    _books_balance(elastic)
    assert not elastic["kept_up"]
    assert elastic["offline_backlog_end_tokens"] > elastic["offline_backlog_start_tokens"] + 0.1 * 3e9
    assert not report["same_work"]
