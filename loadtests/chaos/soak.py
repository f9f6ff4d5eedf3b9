"""The ``soak`` scenario: steady load for ``--soak-minutes`` with 5% of the answers cancelled by
their clients mid-way, no other fault. Every 10 s the RSS of each of the service's roles is read,
with the pids it sums; the row reports each role's slope (MB per hour, least squares: flat is ~0)
over the whole run and past the first window (a replica's warm-up: allocator pools and kernel
shapes it meets for the first time), each taken over the role's longest-lived processes (a pool
scaled to zero and back, or a replaced replica, starts a new process: a line across both would read
the restart as growth), how many times its processes were replaced, the error rate, and the online
TTFT p99 of the first and the last window (5 minutes, or a fifth of a shorter run). ``rss.png``
plots each role's RSS over the run, a line per process."""

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


Sample = tuple[float, float, tuple[int, ...]]  # seconds into the run, MB, the pids summed


def lifetimes(samples: list[Sample]) -> list[list[tuple[float, float]]]:
    """``samples`` cut where the role's processes change: one ``(seconds, MB)`` run per process set."""
    runs: list[list[tuple[float, float]]] = []
    last = None
    for t, mb, pids in samples:
        if pids != last:
            runs.append([])
            last = pids
        runs[-1].append((t, mb))
    return runs


def steady_slope(samples: list[Sample], since_s: float = 0.0) -> float | None:
    """The slope (MB/hour) of the longest-lived processes among ``samples`` from ``since_s`` on."""
    runs = [r for r in lifetimes([p for p in samples if p[0] >= since_s]) if len(r) >= 3]
    return slope_mb_per_hour(max(runs, key=lambda r: r[-1][0] - r[0][0])) if runs else None


def memory_figures(samples: dict[str, list[Sample]], window_s: float) -> dict:
    """Each sampled role's slope over the run and past the first window, and how many times its
    processes were replaced."""
    sampled = {role: s for role, s in samples.items() if s}
    return {"rss_slope_mb_per_hour": {role: steady_slope(s) for role, s in sampled.items()},
            "rss_slope_after_first_window_mb_per_hour": {role: steady_slope(s, window_s) for role, s in sampled.items()},
            "rss_processes_replaced": {role: len(lifetimes(s)) - 1 for role, s in sampled.items()}}


def plot_rss(samples: dict[str, list[Sample]], slopes: dict[str, float | None], window_s: float, path: Path) -> None:
    """Each role's RSS over the run (a line per process), labelled with its ``slopes`` (MB/hour), the
    end of the warm-up window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (role, points) in enumerate(samples.items()):
        slope = slopes.get(role)
        for j, run in enumerate(lifetimes(points)):
            t, mb = np.array(run).T
            ax.plot(t / 60, mb, color=f"C{i}", label=None if j else role if slope is None else f"{role} ({slope:+g} MB/h)")
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
    samples: dict[str, list[Sample]] = {role: [] for role in procs.ROLES}
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            now = time.monotonic() - t0
            for role in procs.ROLES:
                mb, pids = procs.role_memory(role)
                if mb:
                    samples[role].append((now, mb, pids))
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
    memory = memory_figures(samples, window)
    (out / "rss.json").write_text(json.dumps(samples))
    plot_rss(samples, memory["rss_slope_mb_per_hour"], window, out / "rss.png")
    return {**row, "minutes": minutes, "cancel_fraction": CANCEL_FRACTION,
            "error_rate": round(failed / max(1, row["sent"] - row["cut"]), 4),
            **memory, "rss_plot": f"{out.name}/rss.png",
            "rss_samples": {role: len(s) for role, s in samples.items() if s},
            "ttft_p99_first_window_ms": p99(first), "ttft_p99_last_window_ms": p99(last), "window_s": window}
