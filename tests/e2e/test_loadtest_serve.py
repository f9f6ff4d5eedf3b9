"""The CI smoke load test: `foreserve loadtest` for 20 s against the real app it starts (real Ray Serve,
the real model, Locust in its own process); summary.json's numbers are present and sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from app import paths

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray, pytest.mark.locust, pytest.mark.traces]


def test_smoke_load_test_summary_is_present_and_sane(tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())  # the prepared model, read-only
    (home / "traces").symlink_to(paths.traces_dir())  # and traces: built again, they would take two minutes
    env = {**os.environ, "FORESERVE_HOME": str(home), "RAY_AUTH_MODE": "disabled"}
    env.pop("MLFLOW_TRACKING_URI", None)
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "foreserve.cli.main", "loadtest", "--rate", "0.5", "--duration", "20",
                           "--tier-mix", "online=0.7,flex=0.3", "--max-tokens", "32", "--report", str(report)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((report / "summary.json").read_text())
    records = [json.loads(line) for line in (report / "requests.jsonl").read_text().splitlines()]
    tiers = summary["tiers"]
    assert set(tiers) == {"online", "flex"} and summary["rate"] == 0.5 and summary["duration_s"] >= 15
    assert tiers["online"]["requests"] + tiers["flex"]["requests"] == len(records) >= 3
    # the online pool refuses only by the shedding rule (docs/serving.md): a clean 429 with Retry-After
    # for a request that others ahead would push past max_queue_delay_ms; how many depends on the
    # machine's pace (a slow CPU's steps leave 0.5 req/s of 32-token answers little room). Nothing
    # else may fail, and the first request, with nothing ahead of it, is answered
    refused = [r for r in records if r["error"]]
    assert all(r["tier"] == "online" and r["error"].startswith('HTTP 429: {"error":') and r.get("retry_after")
               and "others ahead" in r["error"] for r in refused), refused
    assert sum(t["failures"] for t in tiers.values()) == len(refused), refused
    first = min((r for r in records if r["tier"] == "online"), key=lambda r: r["start"])
    assert not first["error"], first
    for name, t in tiers.items():
        assert t["requests"] >= 1, (name, t)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            q = t[key]
            assert 0 < q["p50"] <= q["p90"] <= q["p99"] and q["mean"] > 0, (name, key, q)
        assert t["ttft_ms"]["p99"] <= t["e2e_ms"]["p99"] and t["e2e_ms"]["p99"] < 300_000
        assert 0 <= t["slo_attainment"] <= 1 and 0 <= t["goodput_rps"] <= t["requests"] / summary["duration_s"] + 1e-3  # rounded
        assert t["output_tokens_per_s"] > 0
    # every answered request got exactly its max_tokens (ignore_eos, the benchmark convention)
    assert all(r["output_tokens"] == r["max_tokens"] <= 32 for r in records if not r["error"])
    health = [json.loads(line) for line in (report / "health.jsonl").read_text().splitlines()]
    assert health and all(h["replicas"]["online"] >= 1 for h in health)
    for name in ("report.html", "latency_cdf.png", "over_time.png", "locust.html", "locust_stats.csv"):
        assert (report / name).exists(), name
