"""Helpers every command group shares."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | None, report: dict, echo: bool = False) -> int:
    """Write ``report`` to ``path`` (parents created) when given; ``echo`` prints it first."""
    text = json.dumps(report, indent=2, default=str)
    if echo:
        print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        print(f"wrote {path}")
    return 0
