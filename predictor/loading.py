"""Loading the predictor that serves: a registry version, the champion, a local directory or ``max``.

Kept apart from ``pipeline.py`` (training, evaluation, promotion) so that what only serves never
imports the training stack: a batch job's predictor actor and the Serve predictor start faster.
"""

from __future__ import annotations

import logging
from pathlib import Path

from predictor.base import LengthPredictor, MaxPredictor
from predictor.buckets import LengthBuckets

logger = logging.getLogger(__name__)


def load_predictor(name: str | Path = "champion", buckets: LengthBuckets | None = None, version: str | None = None,
                   **kwargs) -> LengthPredictor:
    """``champion`` (the MLflow alias), a registry version number, a local model directory or
    ``max``; ``version`` labels a directory (default ``dir:PATH``) or ``max``. Raises
    ``registry.RegistryError``/``ValueError`` with a clear message."""
    from predictor.learned import LearnedPredictor

    if name == "max":
        predictor = MaxPredictor(buckets)
        if version:
            predictor.version = version
        return predictor
    if Path(name).is_dir():
        return LearnedPredictor.from_dir(Path(name), version=version or f"dir:{name}", **kwargs)
    directory, version = _registry_copy(str(name))
    return LearnedPredictor.from_dir(directory, version=version, **kwargs)


def _registry_copy(name: str) -> tuple[Path, str]:
    """The local copy of registry version ``name`` (``champion`` or a number), and its version."""
    if name != "champion" and not name.isdigit():
        raise ValueError(f"unknown predictor {name!r}: use champion, a version number, a model directory, oracle or max")
    from predictor import registry  # NOTE: imports MLflow; only a registry lookup needs it

    return registry.download_version(None if name == "champion" else name)


def resolve_predictor(name: str = "champion") -> tuple[str, str]:
    """``(what load_predictor takes, version label)`` with registry names pinned to their local
    copy: a batch job resolves its predictor once, so all its rows and actors use one version and
    the actors load it without MLflow. A missing or broken champion gives ``("max", "max-fallback")``."""
    if name == "max":
        return "max", MaxPredictor.version
    if Path(name).is_dir():
        return str(name), f"dir:{name}"
    try:
        directory, version = _registry_copy(str(name))
        return str(directory), version
    except Exception as exc:  # noqa: BLE001 - a job must run without a predictor, like serving
        logger.error("length predictor %r unavailable (%s); falling back to max reservation", name, exc)
        return "max", "max-fallback"


def load_predictor_or_max(name: str = "champion", buckets: LengthBuckets | None = None,
                          version: str | None = None) -> LengthPredictor:
    """What serving uses: a missing or broken champion logs the error and reserves for max_tokens."""
    try:
        return load_predictor(name, buckets, version=version)
    except Exception as exc:  # noqa: BLE001 - serving must come up without a predictor
        logger.error("length predictor %r unavailable (%s); falling back to max reservation", name, exc)
        return load_predictor("max", buckets, version="max-fallback")
