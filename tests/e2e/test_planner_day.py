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
