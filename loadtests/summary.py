"""A load test's per-request records → summary.json (DESIGN.md's shape); plain Python + numpy.

One record per request, written by the locustfile as the request ends: ``tier``, ``start`` (epoch s),
``status`` (HTTP status, 0 when the connection failed), ``error`` (None or a message), ``ttft_ms``,
``e2e_ms``, ``itl_ms`` (gaps between streamed content chunks), ``output_tokens`` (from the usage chunk).

TPOT is (E2E − TTFT) / (output tokens − 1). A request meets its SLO when it succeeded and both its
TTFT and its TPOT are within the tier's objectives; goodput is such requests per second of the test
(DistServe's definition), SLO attainment their share of all requests sent. ``key_figures`` and
``medians`` are what the comparisons of runs read (``loadtest ab``, ``loadtest peer``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from loadtests.stages import TIERS


class SLO(BaseModel):
    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)


def read_records(path: Path) -> list[dict]:
    """The records file; a line cut short by a crash is skipped."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def tpot_ms(record: dict) -> float | None:
    if record.get("error") or record.get("ttft_ms") is None:
        return None
    tokens = record.get("output_tokens") or 0
    if tokens <= 1:
        return 0.0
    return (record["e2e_ms"] - record["ttft_ms"]) / (tokens - 1)


def meets_slo(record: dict, slo: SLO) -> bool:
    tpot = tpot_ms(record)
    return tpot is not None and record["ttft_ms"] <= slo.ttft_ms and tpot <= slo.tpot_ms


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": round(float(p50), 2), "p90": round(float(p90), 2), "p99": round(float(p99), 2),
            "mean": round(float(a.mean()), 2)}


def wall_s(records: list[dict]) -> float:
    """From the first request sent to the last one ended."""
    if not records:
        return 0.0
    return max(r["start"] + r["e2e_ms"] / 1000 for r in records) - min(r["start"] for r in records)


def tier_summary(records: list[dict], slo: SLO, seconds: float) -> dict:
    ok = [r for r in records if not r.get("error")]
    good = sum(meets_slo(r, slo) for r in ok)
    return {
        "requests": len(records),
        "failures": len(records) - len(ok),
        "ttft_ms": stats([r["ttft_ms"] for r in ok]),
        "tpot_ms": stats([tpot_ms(r) for r in ok]),
        "itl_ms": stats([gap for r in ok for gap in r.get("itl_ms") or []]),
        "e2e_ms": stats([r["e2e_ms"] for r in ok]),
        "slo_attainment": round(good / len(records), 4) if records else None,
        "goodput_rps": round(good / seconds, 4) if seconds > 0 else 0.0,
        "output_tokens_per_s": round(sum(r.get("output_tokens") or 0 for r in ok) / seconds, 2) if seconds > 0 else 0.0,
    }


def summarize(records: list[dict], slos: dict[str, SLO], config: dict) -> dict:
    """summary.json: per tier (both always present), the SLOs, the offered rate and the test's length.
    ``config`` carries what the run was asked for (rate, stages, mode, tier mix, max_tokens, host...)."""
    seconds = wall_s(records)
    return {
        "tiers": {tier: tier_summary([r for r in records if r["tier"] == tier], slos[tier], seconds) for tier in TIERS},
        "slo": {tier: slos[tier].model_dump() for tier in TIERS},
        "rate": config.get("rate"),
        "duration_s": round(seconds, 2),
        "achieved_rps": round(len(records) / seconds, 4) if seconds > 0 else 0.0,
        "config": config,
    }


def key_figures(summary: dict) -> dict:
    """The online tier's figures the comparison reads; ``good_per_window_rps``: requests within the
    SLOs per second of the arrival window."""
    t = summary["tiers"]["online"]
    good = (t["slo_attainment"] or 0.0) * t["requests"]
    window = summary["config"]["arrival_window_s"]
    return {"requests": t["requests"], "failures": t["failures"], "ttft_p50_ms": t["ttft_ms"]["p50"],
            "ttft_p90_ms": t["ttft_ms"]["p90"], "tpot_p50_ms": t["tpot_ms"]["p50"], "tpot_p90_ms": t["tpot_ms"]["p90"],
            "mean_e2e_ms": t["e2e_ms"]["mean"], "slo_attainment": t["slo_attainment"],
            "good_per_window_rps": round(good / window, 4), "goodput_rps": t["goodput_rps"],
            "output_tokens_per_s": t["output_tokens_per_s"]}


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (a figure missing in a run, e.g. no answer at all, is left out)."""
    out = {}
    for k in runs[0]:
        values = [r[k] for r in runs if r.get(k) is not None]
        out[k] = round(statistics.median(values), 3) if values else None
    return out
