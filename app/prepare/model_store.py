"""The prepared model in foreserve's store, so a node without it fetches it instead of failing.

``foreserve prepare --upload`` puts the model folder under ``models/<name>/`` in the store, file by
file, then ``models/<name>/manifest.json`` (every file's size and SHA-256) last: a manifest means the
upload is whole. ``ensure_local_model`` runs where an engine starts: a node whose data dir lacks the
model fetches it from the store into a temporary folder beside the target, checks every file
against the manifest, and renames it into place, so a failed or concurrent fetch never leaves a
half-written model where an engine would load it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import uuid
from pathlib import Path

from predictor.object_store import ObjectStore

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"
MARKER = ".foreserve-model.json"  # in a fetched copy: the manifest it was checked against


class ModelFetchError(RuntimeError):
    """The model is neither on this node nor (whole and intact) in the store."""


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(folder).parts))


def is_complete(folder: Path) -> bool:
    """A model folder an engine can load: a config and weights (a prepared or fetched one)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def upload_model(folder: Path, store: ObjectStore, name: str | None = None) -> dict:
    """Put model ``folder`` into ``store`` under ``models/<name>/`` (``name``: the folder's name);
    returns the manifest, written last."""
    folder = Path(folder)
    if not is_complete(folder):
        raise ModelFetchError(f"{folder} is not a prepared model folder (config.json and *.safetensors): "
                              "run `foreserve prepare` first")
    name = name or folder.name
    files = {}
    for path in _files(folder):
        rel = path.relative_to(folder).as_posix()
        files[rel] = {"bytes": path.stat().st_size, "sha256": store.put_file(f"models/{name}/{rel}", path)}
    manifest = {"name": name, "files": files, "uploaded_at": time.time()}
    store.put(f"models/{name}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return manifest


def manifest_of(store: ObjectStore, name: str) -> dict | None:
    try:
        return json.loads(store.get(f"models/{name}/{MANIFEST}"))
    except FileNotFoundError:
        return None


def fetch_model(store: ObjectStore, name: str, target: Path) -> Path:
    """Fetch ``models/<name>`` from ``store`` into ``target``, each file checked against the manifest."""
    manifest = manifest_of(store, name)
    if manifest is None:
        raise ModelFetchError(f"no model {name!r} in {store.uri} (models/{name}/{MANIFEST}): "
                              "run `foreserve prepare --upload` on a machine that has it")
    target = Path(target)
    tmp = target.with_name(f".{target.name}.fetch-{uuid.uuid4().hex[:8]}")
    started = time.monotonic()
    try:
        for rel, meta in manifest["files"].items():
            digest = store.get_file(f"models/{name}/{rel}", tmp / rel)
            if digest != meta["sha256"] or (tmp / rel).stat().st_size != meta["bytes"]:
                raise ModelFetchError(f"{store.uri}: models/{name}/{rel} does not match its manifest "
                                      f"(sha256 {digest[:12]}…, expected {meta['sha256'][:12]}…)")
        (tmp / MARKER).write_text(json.dumps({"source": store.uri, "manifest_sha256": _digest(manifest)}))
        try:
            tmp.rename(target)
        except OSError:  # another process on this node fetched it first
            if not is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("fetched model %s from %s into %s in %.1f s", name, store.uri, target, time.monotonic() - started)
    return target


def _digest(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()


def ensure_local_model(target: Path, store: ObjectStore | None) -> Path:
    """``target`` when it holds a model; else fetched from ``store`` (``models/<target's name>``).
    Raises ``ModelFetchError`` naming both places when neither has it."""
    target = Path(target)
    if is_complete(target):
        return target
    if store is None:
        raise ModelFetchError(f"no model at {target} and no store to fetch it from")
    target.parent.mkdir(parents=True, exist_ok=True)
    return fetch_model(store, target.name, target)
