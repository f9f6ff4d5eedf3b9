"""JSONL records in an ``ObjectStore``, written by many processes on many nodes, never appended.

A ``ChunkWriter`` buffers records and puts them as objects of its own, ``<host>-<pid>-<8 hex>-<seq>.jsonl``
(one per flush), so writers never share an object and a reader sees a chunk whole or not at all.
Flushing is synchronous (``flush_s=None``: ``append`` returns once the records are stored) or runs
on a background thread every ``flush_s`` seconds, so the caller's path (an engine step) never
waits on the store; ``close`` stores what is left. A process killed between flushes loses at most
the records of one flush interval; a store that fails keeps them buffered (up to
``max_pending`` lines, then the oldest are dropped and counted) and they go with the next flush.

``read_records`` merges every chunk under a prefix, by key (writer, then its chunks in order);
lines that do not parse or validate are skipped and counted (a local file a crashed writer of an
older layout left half-written), so reading never fails on one bad record.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel, ValidationError

from predictor.object_store import ObjectStore

logger = logging.getLogger(__name__)


def as_store(where: ObjectStore | str | Path) -> ObjectStore:
    return where if isinstance(where, ObjectStore) else ObjectStore(where)


class ChunkWriter:
    """Adds records to ``store`` as chunk objects of this writer's own; thread-safe."""

    def __init__(self, store: ObjectStore | str | Path, flush_s: float | None = None,
                 max_pending: int = 100_000) -> None:
        self.store = as_store(store)
        self.flush_s = flush_s
        self.max_pending = max_pending
        host = socket.gethostname().replace("/", "_") or "host"
        self.name = f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.chunks_written = 0
        self.records_written = 0
        self.dropped = 0  # records given up after the store failed for longer than max_pending lines
        self._pending: list[bytes] = []
        self._lock = threading.Lock()  # guards _pending
        self._flush_lock = threading.Lock()  # one put at a time, chunks in order
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def append(self, record: BaseModel) -> None:
        self.append_many([record])

    def append_many(self, records: Iterable[BaseModel]) -> None:
        """Buffer records; with ``flush_s=None`` store them before returning."""
        lines = [r.model_dump_json().encode() + b"\n" for r in records]
        if not lines:
            return
        with self._lock:
            self._pending.extend(lines)
            over = len(self._pending) - self.max_pending
            if over > 0:
                del self._pending[:over]
                self.dropped += over
        if self.flush_s is None:
            self.flush()
        elif self._thread is None:
            self._start()

    def flush(self) -> int:
        """Store everything buffered as one chunk; returns how many records went. On a failed put
        the records stay buffered and the error is raised."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return 0
            key = f"{self.name}-{self.chunks_written:09d}.jsonl"
            try:
                self.store.put(key, b"".join(batch))
            except BaseException:
                with self._lock:
                    self._pending[:0] = batch
                raise
            self.chunks_written += 1
            self.records_written += len(batch)
            return len(batch)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=f"flush-{self.name}", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_s)
            try:
                self.flush()
            except Exception:
                logger.exception("could not store %d records in %s; kept for the next flush", self.pending, self.store.uri)

    def close(self) -> None:
        """Stop the background thread and store what is buffered (raises if the store fails)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.flush()

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def read_records(store: ObjectStore | str | Path, model: type[BaseModel], prefix: str = "") -> tuple[list, int]:
    """Every valid ``model`` line of every ``*.jsonl`` object under ``prefix`` (by key, then line
    order) and the count of lines skipped because they do not parse or validate. Blank lines are
    ignored; a missing folder is empty."""
    store = as_store(store)
    records: list = []
    skipped_lines = 0
    for key in store.keys(prefix):
        if not key.endswith(".jsonl"):
            continue
        try:
            data = store.get(key)
        except FileNotFoundError:  # removed while we listed
            continue
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                records.append(model.model_validate_json(line))
            except (ValidationError, ValueError):
                skipped_lines += 1
    return records, skipped_lines
