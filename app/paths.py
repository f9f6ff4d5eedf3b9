"""Where foreserve keeps its data: the converted model, traces, MLflow store, feedback, reports.

The edge's helpers: entry points (the CLI, the deployments, a batch job) read these and hand the
values down as arguments and config fields (docs/layers.md). Nothing calls them at import time."""

from __future__ import annotations

import os
from pathlib import Path

from predictor.object_store import ObjectStore
from predictor.store import Store


def home() -> Path:
    """The data dir: ``$FORESERVE_HOME`` or ``~/.cache/foreserve``."""
    return Path(os.environ.get("FORESERVE_HOME", Path.home() / ".cache" / "foreserve")).expanduser()


def model_dir(name: str = "SmolLM2-135M-Instruct") -> Path:
    """A packaged model's converted folder (``app.prepare.model``; default the embedded one)."""
    return home() / "models" / name


def traces_dir() -> Path:
    return home() / "traces"


def reports_dir() -> Path:
    return home() / "reports"


def store(uri: str | None = None) -> ObjectStore:
    """foreserve's store for mutable state (``AppConfig.store``): ``uri``, else ``$FORESERVE_STORE``,
    else the data dir. Every node of a cluster must be given the same one (docs/cluster.md)."""
    return ObjectStore(uri or os.environ.get("FORESERVE_STORE") or home())


def feedback_dir() -> Path:
    """The data dir's feedback folder (where ``feedback_store()`` is on one machine)."""
    return home() / "feedback"


def feedback_store(uri: str | None = None) -> ObjectStore:
    """The feedback records: one per finished request (the engines write, retraining reads)."""
    return store(uri).child("feedback")


def predictor_store() -> Store:
    """The length predictor's MLflow store: ``$MLFLOW_TRACKING_URI``, else sqlite under the data dir."""
    return Store(home(), os.environ.get("MLFLOW_TRACKING_URI") or None)
