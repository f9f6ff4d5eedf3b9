"""The feedback store: one record per finished request, later used to retrain the length predictor.

Layout: ``<root>/<hostname>-<pid>-<8 hex>.jsonl``, one append-only JSONL file per writer, so
processes never share a file. Inside a process, threads share a writer: each record is one
``os.write`` of one complete line on an ``O_APPEND`` fd, under a lock. With ``fsync=True`` (the
default) a record is on disk when ``append`` returns. A writer killed mid-line leaves at most a
partial last line in its own file; the reader skips (and counts) any line that does not parse
or validate, so it never crashes and never loses the other records.

The root is the caller's: the data dir's ``feedback`` folder (``app.paths.feedback_dir()``) at the
entry points, a job's or a test's own folder elsewhere.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel, Field, ValidationError


class FeedbackRecord(BaseModel):
    """What the engine knew and what actually happened for one finished request."""

    request_id: str = Field(description="The engine's request id.")
    prompt: str = Field(description="The user message text the predictor reads.")
    prompt_token_ids: list[int] | None = Field(None, description="The prompt's token ids, when kept.")
    predicted_bucket: int | None = Field(None, ge=0, description="The predicted length bucket; None without a predictor.")
    predicted_bound_tokens: int | None = Field(None, ge=0, description="The predictor's output bound for the request, in tokens, as it came (before any growth; at the predictor's own quantile, whatever the pool reserved), clamped to max_tokens.")
    output_tokens: int = Field(ge=0, description="The number of tokens actually generated.")
    finish_reason: str = Field(description='Why generation ended: "stop", "length", "abort", ...')
    ignore_eos: bool = Field(False, description="The client had EOS ignored (benchmarks, load tests) or forced a "
                             "replayed length: the length is the client's, not the model's, and is no label.")
    tier: str = Field(description="The service tier the request ran in.")
    model_id: str = Field(description="The served model's id.")
    predictor_version: str | None = Field(None, description="Name/version of the predictor that made the prediction.")
    timestamp_s: float = Field(default_factory=time.time, description="When the request finished (Unix seconds).")
    source: str = Field("online", description='Where the record comes from: "online" (the engine), "offline", ...')


class FeedbackWriter:
    """Appends records to this writer's own JSONL file under ``root``; thread-safe.

    The file is created on the first append. After a ``fork`` the child opens a file of its own.
    """

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.path: Path | None = None
        self._fd: int | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _open(self) -> int:
        """Return the fd of this process's file, creating the file (and root) if needed."""
        if self._fd is not None and self._pid == os.getpid():
            return self._fd
        # NOTE: after a fork the inherited fd and lock belong to the parent's file; start afresh.
        self._pid = os.getpid()
        self.root.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().replace(os.sep, "_") or "host"
        self.path = self.root / f"{host}-{self._pid}-{uuid.uuid4().hex[:8]}.jsonl"
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(self.path, flags, 0o644)
        if self.fsync:  # make the new directory entry durable too
            dir_fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return self._fd

    def append(self, record: FeedbackRecord) -> None:
        """Write one record as one line; on return it is on disk (when ``fsync`` is on)."""
        self.append_many([record])

    def append_many(self, records: Iterable[FeedbackRecord]) -> None:
        """Write several records with one write (and one fsync)."""
        data = b"".join(r.model_dump_json().encode() + b"\n" for r in records)
        if not data:
            return
        with self._lock:
            fd = self._open()
            view = memoryview(data)
            try:
                while view:  # a regular file takes it all in one write; loop only for short writes
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            except OSError:
                # NOTE: the file may end mid-line now; the next record goes to a new file, so the
                # fragment stays one skipped tail instead of swallowing the next good line
                os.close(fd)
                self._fd = None
                raise

    def close(self) -> None:
        """Close the file; a later append opens a new one."""
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FeedbackWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def scan_jsonl(root: Path, model: type[BaseModel]) -> tuple[list, int]:
    """Every valid ``model`` line of every ``*.jsonl`` in ``root`` (by file name, then line order),
    and the count of lines skipped because they do not parse or validate (a crashed writer's
    partial last line). Blank lines are ignored; a missing root is empty."""
    records: list = []
    skipped_lines = 0
    if not Path(root).is_dir():
        return records, skipped_lines
    for path in sorted(Path(root).glob("*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    records.append(model.model_validate_json(line))
                except (ValidationError, ValueError):
                    skipped_lines += 1
    return records, skipped_lines


def scan_feedback(root: Path, since_s: float | None = None) -> tuple[list[FeedbackRecord], int]:
    """The feedback records under ``root`` (see ``scan_jsonl``) and the skipped-line count;
    ``since_s`` keeps records with ``timestamp_s >= since_s``."""
    records, skipped_lines = scan_jsonl(Path(root), FeedbackRecord)
    if since_s is not None:
        records = [r for r in records if r.timestamp_s >= since_s]
    return records, skipped_lines


def read_feedback(root: Path, since_s: float | None = None) -> list[FeedbackRecord]:
    """The valid records under ``root`` (see ``scan_feedback``), without the skipped count."""
    return scan_feedback(root, since_s)[0]


def count_feedback(root: Path) -> int:
    """The number of valid records under ``root``."""
    return len(read_feedback(root))
