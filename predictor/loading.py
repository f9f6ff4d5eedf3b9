"""Loading the predictor that serves: a registry version, the champion, a local directory or ``max``.

Kept apart from ``pipeline.py`` (training, evaluation, promotion) so that what only serves never
imports the training stack: a batch job's predictor actor and the Serve predictor start faster.

A registry name (``champion``, a version number) is looked up in the ``Store`` the caller gives
(``app.paths.predictor_store()`` at the entry points); a directory or ``max`` needs none.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

from predictor.base import LengthPredictor, MaxPredictor
from predictor.buckets import LengthBuckets
from predictor.store import Store, cached_copy

logger = logging.getLogger(__name__)
LOOKUPS_FILE = "lookups.json"  # in <home>/mlflow/cache: registry lookups and the store state they saw


def _store_state(store: Store) -> list | None:
    """Size and mtime of a local sqlite store and its journals; None for any other store (never cached).

    NOTE: every registry write (a promotion, a new version) changes them; a lookup does not."""
    uri = store.uri()
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
                   store: Store | None = None, **kwargs) -> LengthPredictor:
    """``champion`` (the MLflow alias), a registry version number (both looked up in ``store``), a
    local model directory or ``max``; ``version`` labels a directory (default ``dir:PATH``) or
    ``max``. Raises ``registry.RegistryError``/``ValueError`` with a clear message."""
    from predictor.learned import LearnedPredictor

    if name == "max":
        predictor = MaxPredictor(buckets)
        if version:
            predictor.version = version
        return predictor
    if Path(name).is_dir():
        return LearnedPredictor.from_dir(Path(name), version=version or f"dir:{name}", **kwargs)
    directory, version = _registry_copy(str(name), store)
    return LearnedPredictor.from_dir(directory, version=version, **kwargs)


def _registry_copy(name: str, store: Store | None = None) -> tuple[Path, str]:
    """The local copy of registry version ``name`` (``champion`` or a number), and its version.

    A local sqlite store that has not changed since the last lookup of ``name`` gives that
    lookup's answer without importing MLflow (~1.5 s of CPU: a batch job's predictor actor and a
    Serve predictor replica start that much sooner)."""
    if name != "champion" and not name.isdigit():
        raise ValueError(f"unknown predictor {name!r}: use champion, a version number, a model directory or max")
    if store is None:
        raise ValueError(f"looking up the registry's {name!r} needs its store (app.paths.predictor_store())")
    state, lookups_path = _store_state(store), store.cache_dir() / LOOKUPS_FILE
    try:
        lookups = json.loads(lookups_path.read_text())
    except (OSError, ValueError):
        lookups = {}
    hit = lookups.get(name) if state is not None else None
    if hit and hit.get("store") == state and cached_copy(store.cache_dir(str(hit["version"]))) == Path(hit["dir"]):
        return Path(hit["dir"]), str(hit["version"])  # NOTE: a damaged copy misses: the registry repairs it
    from predictor import registry  # NOTE: imports MLflow; only a registry lookup needs it

    registry.configure(store)
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


def resolve_predictor(name: str = "champion", store: Store | None = None) -> tuple[str, str]:
    """``(what load_predictor takes, version label)`` with registry names pinned to their local
    copy: a batch job resolves its predictor once, so all its rows and actors use one version and
    the actors load it without MLflow. A missing or broken champion gives ``("max", "max-fallback")``."""
    if name == "max":
        return "max", MaxPredictor.version
    if Path(name).is_dir():
        return str(name), f"dir:{name}"
    try:
        directory, version = _registry_copy(str(name), store)
        return str(directory), version
    except Exception as exc:  # noqa: BLE001 - a job must run without a predictor, like serving
        logger.error("length predictor %r unavailable (%s); falling back to max reservation", name, exc)
        return "max", "max-fallback"


def load_predictor_or_max(name: str = "champion", buckets: LengthBuckets | None = None,
                          version: str | None = None, store: Store | None = None) -> LengthPredictor:
    """What serving uses: a missing or broken champion logs the error and reserves for max_tokens."""
    try:
        return load_predictor(name, buckets, version=version, store=store)
    except Exception as exc:  # noqa: BLE001 - serving must come up without a predictor
        logger.error("length predictor %r unavailable (%s); falling back to max reservation", name, exc)
        fallback = load_predictor("max", buckets, version="max-fallback")
        fallback.unavailable = f"{name}: {type(exc).__name__}: {exc}"
        return fallback
