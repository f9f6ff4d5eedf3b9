"""The planner's CPU calibration measures the real SmolLM2 (the fits on known constants: tests/unit/test_planner.py)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_calibration_measures_the_real_model():
    from autoscale.planning.calibrate import calibrate

    report = calibrate([1, 8], context=64, repeats=2)
    assert [p["batch_size"] for p in report["points"]] == [1, 8]
    assert all(p["measured_ms"] > 0 and p["predicted_ms"] > 0 for p in report["points"])
    assert report["fitted"]["memory_bandwidth_bytes_per_s"] > 0 and report["fitted"]["flops"] > 0
