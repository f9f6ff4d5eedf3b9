"""report.html of a chaos run: the summary table, then each scenario's own figures."""

from __future__ import annotations

import html
import json
from pathlib import Path

COLUMNS = ("scenario", "fault", "sent", "answered", "clean_error", "cut", "hung", "broken", "recovery_s",
           "health_ok_after_s")


def _memory(row: dict) -> str:
    before, after = row.get("memory_mb_before") or {}, row.get("memory_mb_after") or {}
    return ", ".join(f"{k} {before.get(k, 0):.0f}→{after.get(k, 0):.0f}" for k in after if before.get(k) or after.get(k))


def _plot(row: dict) -> str:
    """A scenario's figure (the soak's RSS over time), beside report.html."""
    return f'<img src="{html.escape(row["rss_plot"])}" alt="RSS over time">' if row.get("rss_plot") else ""


def write_html(path: Path, summary: dict) -> None:
    head = "".join(f"<th>{c}</th>" for c in (*COLUMNS, "RSS MB before→after"))
    rows = []
    for row in summary["scenarios"]:
        bad = row["hung"] or row["broken"]
        cells = "".join(f"<td>{html.escape(str(row.get(c, '')))}</td>" for c in COLUMNS)
        rows.append(f"<tr class={'bad' if bad else 'ok'}>{cells}<td>{html.escape(_memory(row))}</td></tr>")
    details = "".join(
        f"<h3>{html.escape(r['scenario'])}</h3>{_plot(r)}<pre>{html.escape(json.dumps(r, indent=1))}</pre>"
        for r in summary["scenarios"])
    path.write_text(f"""<!doctype html><meta charset=utf-8><title>foreserve chaos</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{border:1px solid #ccc;padding:4px 8px}}
table{{border-collapse:collapse}} tr.bad{{background:#fdd}} tr.ok{{background:#efe}} pre{{background:#f6f6f6;padding:8px}}</style>
<h1>foreserve chaos</h1><p>{summary['rate']} req/s for {summary['duration_s']} s per load scenario, fault at
{summary['inject_s']} s; hung {summary['hung']}, broken {summary['broken']}.</p>
<table><tr>{head}</tr>{''.join(rows)}</table>{details}""")
