"""Where foreserve keeps its data: the converted model, traces, MLflow store, feedback, reports."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The data dir: ``$FORESERVE_HOME`` or ``~/.cache/foreserve``."""
    return Path(os.environ.get("FORESERVE_HOME", Path.home() / ".cache" / "foreserve")).expanduser()


def model_dir() -> Path:
    return home() / "models" / "SmolLM2-135M-Instruct"


def traces_dir() -> Path:
    return home() / "traces"


def reports_dir() -> Path:
    return home() / "reports"
