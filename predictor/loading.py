"""Loading the predictor that serves: a registry version, the champion, a local directory or ``max``.

Kept apart from ``pipeline.py`` (training, evaluation, promotion) so that what only serves never
imports the training stack: a batch job's predictor actor and the Serve predictor start faster.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from app import paths
from predictor.base import LengthPredictor, MaxPredictor
from predictor.buckets import LengthBuckets

logger = logging.getLogger(__name__)
LOOKUPS_FILE = "lookups.json"  # in <home>/mlflow/cache: registry lookups and the store state they saw
DOWNLOAD_MARKER = ".foreserve-download.json"  # written into a complete cache entry


def tracking_uri(uri: str | None = None) -> str:
    """``uri``, else ``$MLFLOW_TRACKING_URI``, else the sqlite store under the data dir."""
    if uri or (uri := os.environ.get("MLFLOW_TRACKING_URI")):
        return uri
    home = (paths.home() / "mlflow").resolve()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home}/mlflow.db"


def _store_state() -> list | None:
    """Size and mtime of a local sqlite store and its journals; None for any other store (never cached).

    NOTE: every registry write (a promotion, a new version) changes them; a lookup does not."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri.removeprefix("sqlite:///"))
    return [_size_and_mtime(p) for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-journal"))]


def _size_and_mtime(path: Path) -> list[int] | None:
    """One stat (a journal may vanish between two: sqlite deletes it at each commit); None if absent."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns]


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
    """The local copy of registry version ``name`` (``champion`` or a number), and its version.

    A local sqlite store that has not changed since the last lookup of ``name`` gives that
    lookup's answer without importing MLflow (~1.5 s of CPU: a batch job's predictor actor and a
    Serve predictor replica start that much sooner)."""
    if name != "champion" and not name.isdigit():
        raise ValueError(f"unknown predictor {name!r}: use champion, a version number, a model directory or max")
    state, lookups_path = _store_state(), cache_dir() / LOOKUPS_FILE
    try:
        lookups = json.loads(lookups_path.read_text())
    except (OSError, ValueError):
        lookups = {}
    hit = lookups.get(name) if state is not None else None
    if hit and hit.get("store") == state and cached_copy(cache_dir(str(hit["version"]))) == Path(hit["dir"]):
        return Path(hit["dir"]), str(hit["version"])  # NOTE: a damaged copy misses: the registry repairs it
    from predictor import registry  # NOTE: imports MLflow; only a registry lookup needs it

    directory, version = registry.download_version(None if name == "champion" else name)
    if state is not None:  # NOTE: the state from before the lookup: a write during it makes a miss next time
        lookups[name] = {"store": state, "dir": str(directory), "version": version}
        tmp = lookups_path.with_name(f".{LOOKUPS_FILE}.{uuid.uuid4().hex}")
        try:
            tmp.write_text(json.dumps(lookups))
            tmp.replace(lookups_path)
        except OSError:
            tmp.unlink(missing_ok=True)
    return directory, version


def cache_dir(version: str | None = None) -> Path:
    """Where registry version ``version``'s download is kept (None: the folder of all of them)."""
    root = paths.home() / "mlflow" / "cache"
    return root / version if version is not None else root


def bad_files(predictor_dir: Path, manifest: dict[str, int]) -> list[str]:
    """The manifest entries that are missing or have another size under ``predictor_dir``."""
    return sorted(rel for rel, size_bytes in manifest.items()
                  if not (path := predictor_dir / rel).is_file() or path.stat().st_size != size_bytes)


def cached_copy(cache: Path, source: str | None = None) -> Path | None:
    """The predictor dir of a complete, undamaged download in ``cache`` (one registry version's
    entry), if it came from ``source`` (any, when None); else None."""
    try:
        marker = json.loads((cache / DOWNLOAD_MARKER).read_text())
    except (OSError, ValueError):
        return None
    manifest, predictor_dir = marker.get("manifest"), cache / str(marker.get("predictor"))
    if (source is not None and marker.get("source") != source) or not manifest or bad_files(predictor_dir, manifest):
        return None
    return predictor_dir


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
