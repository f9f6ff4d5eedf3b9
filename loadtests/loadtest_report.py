"""report.html for a load test: the summary table and plots (latency CDFs with the SLOs, latency over
time with the SLO line, replicas and queued requests per pool over time), PNGs written alongside."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtests.summary import tpot_ms  # noqa: E402

COLORS = {"online": "tab:blue", "flex": "tab:orange", "offline": "tab:orange"}


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, **kw)


def _ok(records: list[dict], tier: str) -> list[dict]:
    return [r for r in records if r["tier"] == tier and not r.get("error")]


def plot_cdfs(records: list[dict], summary: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (label, key) in zip(axes, (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E latency", "e2e_ms"))):
        for tier in summary["tiers"]:
            values = np.sort([tpot_ms(r) if key == "tpot_ms" else r[key] for r in _ok(records, tier)])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=COLORS[tier], label=tier)
                slo = summary["slo"][tier].get(key)
                if slo:
                    ax.axvline(slo, color=COLORS[tier], linestyle="--", linewidth=1, label=f"{tier} SLO")
        ax.set(xlabel=f"{label} (ms)", ylabel="fraction of requests", title=f"{label} CDF")
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_over_time(records: list[dict], summary: dict, health: list[dict], path: Path) -> None:
    t0 = min(r["start"] for r in records)
    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    for tier in summary["tiers"]:
        ok = _ok(records, tier)
        if ok:
            axes[0].scatter([r["start"] - t0 for r in ok], [r["ttft_ms"] for r in ok], s=10, color=COLORS[tier], label=tier)
            axes[1].scatter([r["start"] - t0 for r in ok], [tpot_ms(r) for r in ok], s=10, color=COLORS[tier], label=tier)
            axes[0].axhline(summary["slo"][tier]["ttft_ms"], color=COLORS[tier], linestyle="--", linewidth=1, label=f"{tier} SLO")
            axes[1].axhline(summary["slo"][tier]["tpot_ms"], color=COLORS[tier], linestyle="--", linewidth=1, label=f"{tier} SLO")
        failed = [r for r in records if r["tier"] == tier and r.get("error")]
        if failed:
            axes[0].scatter([r["start"] - t0 for r in failed], [0] * len(failed), marker="x", color="red", label=f"{tier} failed")
    axes[0].set(ylabel="TTFT (ms)", title="Latency by arrival time")
    axes[1].set(ylabel="TPOT (ms)")
    ax = axes[2]
    if health:
        times = [h["t"] - t0 for h in health]
        top = 1
        for pool, style in (("online", dict(linewidth=3)), ("offline", dict(linestyle="--", linewidth=2))):
            replicas = [(h.get("replicas") or {}).get(pool) for h in health]
            if any(isinstance(v, int) for v in replicas):
                top = max([top] + [v for v in replicas if isinstance(v, int)])
                ax.step(times, [v if isinstance(v, int) else np.nan for v in replicas], where="post",
                        color=COLORS[pool], label=f"{pool} replicas", **style)
        ax.set_ylim(-0.2, top + 0.5)
        ax.yaxis.get_major_locator().set_params(integer=True)
        twin = ax.twinx()
        for pool in ("online", "offline"):
            waiting = [((h.get("pools") or {}).get(pool) or {}).get("num_waiting") for h in health]
            twin.plot(times, [np.nan if w is None else w for w in waiting], color=COLORS[pool], alpha=0.4,
                      linestyle=":", label=f"{pool} waiting")
        twin.set_ylabel("requests waiting in the engine")
        _legend(twin, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no /health samples", ha="center", transform=ax.transAxes)
    ax.set(xlabel="seconds since the first request", ylabel="running replicas")
    _legend(ax, loc="upper left")
    for a in axes:
        a.grid(alpha=0.3)
    _legend(axes[0])
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _table(summary: dict) -> str:
    rows = []
    for tier, s in summary["tiers"].items():
        if not s["requests"]:
            continue
        cells = [tier, s["requests"], s["failures"]]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            cells.append(" / ".join("–" if s[key][q] is None else f"{s[key][q]:.0f}" for q in ("p50", "p90", "p99")))
        cells += [f"{s['slo_attainment']:.1%}", f"{s['goodput_rps']:.3f}", f"{s['output_tokens_per_s']:.1f}"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    head = ["tier", "requests", "failures", "TTFT ms p50/p90/p99", "TPOT ms", "ITL ms", "E2E ms", "SLO attainment",
            "goodput req/s", "output tok/s"]
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


def _img(path: Path) -> str:
    return f'<img src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}" alt="{path.stem}">'


def write_report(report: Path, summary: dict, records: list[dict]) -> Path:
    """Write latency_cdf.png, over_time.png and report.html (self-contained) into ``report``."""
    health = []
    if (report / "health.jsonl").exists():
        health = [json.loads(line) for line in (report / "health.jsonl").read_text().splitlines() if line.strip()]
    plot_cdfs(records, summary, report / "latency_cdf.png")
    plot_over_time(records, summary, health, report / "over_time.png")
    config = html.escape(json.dumps(summary["config"], indent=1))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>foreserve load test</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style>
</head><body><h1>foreserve load test</h1>
<p>{summary['duration_s']:.0f} s, offered rate {summary['rate']} req/s, SLOs {html.escape(json.dumps(summary['slo']))}.
Locust's own report: <a href="locust.html">locust.html</a>; raw numbers: summary.json, requests.jsonl, locust_stats.csv.</p>
{_table(summary)}
<h2>Latency CDFs</h2>{_img(report / 'latency_cdf.png')}
<h2>Over time</h2>{_img(report / 'over_time.png')}
<h2>Run</h2><pre>{config}</pre></body></html>"""
    out = report / "report.html"
    out.write_text(page)
    return out
