"""foreserve's store for mutable state: whole objects under one URI, on any filesystem ``pyarrow.fs``
knows (a local folder, ``file://``, ``s3://bucket/prefix?endpoint_override=…``, ``gs://`` …).

Every node of a cluster that is handed the same URI sees the same objects, which is what feedback,
batch parts and results, and the Batch API's files and records need (docs/cluster.md). The rules
that make it safe on an object store:

- An object is written whole: ``put`` replaces it at once (readers see the old object or the new one,
  never a part). A local folder gets there by writing a hidden temporary file and renaming it; an
  object store's PUT is atomic by itself.
- Nothing is appended to a shared object: writers that add records put new objects of their own
  (``ChunkWriter``), and readers list and merge them (``read_records``).
- Keys are ``/``-separated paths below the store's root. Names starting with ``.`` are temporary
  and never listed.

It sits in the predictor's layer because the predictor's feedback is its first user; the batch job
and the Batch API (``app.batch``) use it too. ``ObjectStore`` is picklable: a Ray task or actor gets
the URI and opens the filesystem where it runs.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs as pafs


class ObjectStore:
    """Objects under ``uri``: a local path (made absolute) or any URI ``pyarrow.fs`` opens."""

    def __init__(self, uri: str | Path) -> None:
        text = str(uri)
        self.uri = text if "://" in text else str(Path(text).expanduser().absolute())
        self._opened: tuple[pafs.FileSystem, str] | None = None

    # -- where --------------------------------------------------------------------------------
    @property
    def local_root(self) -> Path | None:
        """The folder behind a local store (a plain path or ``file://``); None for a remote one."""
        if "://" not in self.uri:
            return Path(self.uri)
        parts = urlsplit(self.uri)
        return Path(parts.path) if parts.scheme == "file" else None

    def child(self, *keys: str) -> ObjectStore:
        """The store under ``keys`` (a sub-folder or key prefix), with this store's URI options kept."""
        path = "/".join(k.strip("/") for k in keys if k.strip("/"))
        base, sep, query = self.uri.partition("?")
        return ObjectStore(f"{base.rstrip('/')}/{path}{sep}{query}")

    def _fs(self) -> tuple[pafs.FileSystem, str]:
        if self._opened is None:
            root = self.local_root
            if root is not None:
                self._opened = (pafs.LocalFileSystem(), str(root))
            else:
                fs, base = pafs.FileSystem.from_uri(self.uri)
                self._opened = (fs, base.rstrip("/"))
        return self._opened

    def _path(self, key: str) -> str:
        key = key.strip("/")
        if not key or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"bad object key {key!r}")
        return f"{self._fs()[1]}/{key}"

    # -- objects ------------------------------------------------------------------------------
    @contextmanager
    def _writer(self, key: str) -> Iterator:
        """A stream that becomes object ``key`` whole when the block ends without an error. A local
        store writes a temporary file beside it, makes it durable and renames it over it; S3 and GCS
        make an upload visible whole on close."""
        root = self.local_root
        if root is None:
            fs, _ = self._fs()
            with fs.open_output_stream(self._path(key)) as out:
                yield out
            return
        path = root / key.strip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
        try:
            with open(tmp, "xb") as out:
                yield out
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def put(self, key: str, data: bytes) -> None:
        """Write object ``key`` whole (replacing any older one at once)."""
        with self._writer(key) as out:
            out.write(data)

    def put_file(self, key: str, source: Path, chunk_bytes: int = 8 << 20) -> str:
        """Write object ``key`` from file ``source``, streamed (a model's weights never sit in memory
        whole); returns the SHA-256 of what was written."""
        digest = hashlib.sha256()
        with open(source, "rb") as f, self._writer(key) as out:
            while chunk := f.read(chunk_bytes):
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()

    def get_file(self, key: str, target: Path, chunk_bytes: int = 8 << 20) -> str:
        """Copy object ``key`` into file ``target`` (streamed); returns the SHA-256 of what was read.
        FileNotFoundError if there is no such object."""
        digest = hashlib.sha256()
        fs, _ = self._fs()
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(self._path(key)) as f, open(target, "wb") as out:
            while chunk := f.read(chunk_bytes):
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()

    def get(self, key: str) -> bytes:
        """Object ``key``'s bytes; FileNotFoundError if there is none."""
        fs, _ = self._fs()
        with fs.open_input_stream(self._path(key)) as f:
            return f.readall()

    def exists(self, key: str) -> bool:
        fs, _ = self._fs()
        return fs.get_file_info(self._path(key)).type == pafs.FileType.File

    def size(self, key: str) -> int:
        """Object ``key``'s size in bytes; FileNotFoundError if there is none."""
        fs, _ = self._fs()
        info = fs.get_file_info(self._path(key))
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{self.uri}: no object {key!r}")
        return int(info.size)

    def delete(self, key: str) -> None:
        """Remove object ``key`` (nothing happens if there is none)."""
        fs, _ = self._fs()
        try:
            fs.delete_file(self._path(key))
        except FileNotFoundError:
            pass

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under folder ``prefix`` (all of them when empty), recursively, sorted; relative
        to the store's root. Temporary names (a part starting with ``.``) are left out."""
        fs, base = self._fs()
        folder = f"{base}/{prefix.strip('/')}" if prefix.strip("/") else base
        infos = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
        found = []
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            key = info.path[len(base):].lstrip("/")
            if not any(part.startswith(".") for part in key.split("/")):
                found.append(key)
        return sorted(found)

    # -- pickling: the filesystem is opened again where the store is used -----------------------
    def __getstate__(self) -> dict:
        return {"uri": self.uri}

    def __setstate__(self, state: dict) -> None:
        self.uri, self._opened = state["uri"], None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectStore) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __repr__(self) -> str:
        return f"ObjectStore({self.uri!r})"


def object_at(uri: str | Path) -> tuple[ObjectStore, str]:
    """The store holding the single object at ``uri``, and its key:
    ``s3://bucket/jobs/in.jsonl?endpoint_override=…`` → (``ObjectStore("s3://bucket/jobs?endpoint_override=…")``,
    ``"in.jsonl"``); a local path → (its folder, its name)."""
    text = str(uri)
    if "://" not in text:
        path = Path(text).expanduser().absolute()
        return ObjectStore(path.parent), path.name
    base, sep, query = text.partition("?")
    parent, _, name = base.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise ValueError(f"{uri}: not the URI of an object (a bucket or folder, then its name)")
    return ObjectStore(f"{parent}{sep}{query}"), name
