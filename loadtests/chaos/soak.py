"""The ``soak`` scenario: steady load for ``--soak-minutes`` with 5% of the answers cancelled by
their clients mid-way, no other fault. Every 10 s the RSS of each of the service's roles is read;
the row reports each role's slope (MB per hour, least squares: flat is ~0) over the whole run and
past the first window (a replica's warm-up: allocator pools and kernel shapes it meets for the first
time), the error rate, and the online TTFT p99 of the first and the last window (5 minutes, or a
fifth of a shorter run). ``rss.png`` plots each role's RSS over the run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np

from loadtests.chaos import procs
from loadtests.chaos.load import start_load
from loadtests.chaos.score import score
from loadtests.summary import read_records

CANCEL_FRACTION = 0.05


def slope_mb_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples, in MB per hour."""
    if len(samples) < 3:
        return None
    t, mb = np.array(samples).T
    return round(float(np.polyfit(t, mb, 1)[0]) * 3600, 1)


def plot_rss(samples: dict[str, list[tuple[float, float]]], slopes: dict[str, float | None], window_s: float,
             path: Path) -> None:
    """Each role's RSS over the run, labelled with its ``slopes`` (MB/hour), the end of the warm-up window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for role, points in samples.items():
        if points:
            t, mb = np.array(points).T
            slope = slopes.get(role)
            ax.plot(t / 60, mb, label=role if slope is None else f"{role} ({slope:+g} MB/h)")
    ax.axvline(window_s / 60, color="grey", linestyle="--", label="end of the first window")
    ax.set(xlabel="minutes into the soak", ylabel="RSS (MB)", title="RSS of each role under steady load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def p99(values: list[float]) -> float | None:
    return round(float(np.percentile(values, 99)), 1) if values else None


def soak(url: str, out: Path, key: str, rate: float, minutes: float, every_s: float = 10.0) -> dict:
    duration_s = minutes * 60
    samples: dict[str, list[tuple[float, float]]] = {role: [] for role in procs.ROLES}
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            now = time.monotonic() - t0
            for role, mb in procs.memory().items():
                if mb:
                    samples[role].append((now, mb))
            stop.wait(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.time()
    start_load(url, out, key, rate, duration_s, CANCEL_FRACTION).join()
    stop.set()
    sampler.join()
    records = read_records(out / "requests.jsonl")
    row = score(records, None)
    window = min(300.0, duration_s / 5)
    online = [r for r in records if r.get("tier") == "online" and r.get("ttft_ms") is not None and not r.get("error")]
    first = [r["ttft_ms"] for r in online if r["start"] - start < window]
    last = [r["ttft_ms"] for r in online if r["start"] - start >= duration_s - window]
    failed = row["clean_error"] + row["broken"] + row["hung"]
    slopes = {role: slope_mb_per_hour(s) for role, s in samples.items() if s}
    (out / "rss.json").write_text(json.dumps(samples))
    plot_rss(samples, slopes, window, out / "rss.png")
    return {**row, "minutes": minutes, "cancel_fraction": CANCEL_FRACTION,
            "error_rate": round(failed / max(1, row["sent"] - row["cut"]), 4),
            "rss_slope_mb_per_hour": slopes,
            "rss_slope_after_first_window_mb_per_hour": {
                role: slope_mb_per_hour([p for p in s if p[0] >= window]) for role, s in samples.items() if s},
            "rss_plot": f"{out.name}/rss.png",
            "rss_samples": {role: len(s) for role, s in samples.items() if s},
            "ttft_p99_first_window_ms": p99(first), "ttft_p99_last_window_ms": p99(last), "window_s": window}
