"""Human-readable tables (and later plots) for benchmark JSON."""

from __future__ import annotations

COLUMNS = [
    ("policy", "policy", "{}"),
    ("scheduler", "sched", "{}"),
    ("output_tokens_per_s", "tok/s", "{:.1f}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("mean_running_batch", "batch", "{:.1f}"),
    ("peak_kv_used_tokens", "peak KV", "{}"),
    ("preemptions", "preempt", "{}"),
    ("recomputed_tokens", "recomputed", "{}"),
]


def format_table(report: dict) -> str:
    rows = [[fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in COLUMNS] for r in report["results"]]
    header = [title for _, title, _ in COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    for key, value in report.get("ratios", {}).items():
        out.append(f"{key}: {value}")
    return "\n".join(out)


def print_table(report: dict) -> None:
    print(format_table(report))
