"""The 30-minute soak (``foreserve chaos --scenarios soak``): steady load at a rate the service
answers, 5% of the answers cancelled by their clients mid-way. The one test outside ``make test``:
it takes half an hour by design (``make test-soak``). Nothing may hang or break and under 0.1% of
the requests may fail; the RSS slopes and TTFT p99s are printed for docs/chaos.md."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.model, pytest.mark.ray, pytest.mark.locust,
              pytest.mark.traces, pytest.mark.timeout(3000)]


def test_thirty_minutes_of_steady_load_with_cancels_fail_nothing(tmp_path, home_with_model):
    from loadtests.chaos.run import run_chaos

    summary = run_chaos(tmp_path / "report", ["soak"], rate=0.3, soak_minutes=30.0)
    (row,) = summary["scenarios"]
    print(json.dumps({k: row.get(k) for k in ("sent", "answered", "cut", "error_rate", "rss_slope_mb_per_hour",
                                              "ttft_p99_first_window_ms", "ttft_p99_last_window_ms")}))
    assert row["hung"] == row["broken"] == 0 and row["sent"] >= 300, row
    assert row["cut"] >= 1 and row["error_rate"] < 0.001, row  # the clients did cancel; nothing else failed
