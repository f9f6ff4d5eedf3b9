"""Offline batch jobs' input and output, in OpenAI's Batch API line format, exactly once.

Input: JSONL (or Parquet) lines ``{"custom_id", "method": "POST", "url": "/v1/chat/completions"
(or "/v1/completions"), "body": {...}}``, in a local file or one object of a store (``predictor.object_store.object_at``:
``s3://bucket/jobs/in.jsonl?endpoint_override=…``). A bad line (invalid JSON, no custom_id, a
custom_id seen before, a bad body) becomes an error row, never a failed job; the first occurrence of
a duplicated custom_id is still answered. A body without ``model`` uses the served model.

Output: a job's state lives whole in one ``ObjectStore`` (a local folder or a store URI that every
node sees): workers put their finished rows as chunk objects of their own under ``parts/``
(``predictor.records.ChunkWriter``; ``PartWriter`` decides when a chunk is stored), and the driver
puts ``status.json`` and ``results.jsonl`` whole. Rows are keyed by their input line number, so a
resumed job skips what any part already holds, and ``finalize`` writes ``results.jsonl`` with
exactly one line per input line, in input order (a line answered twice keeps its first answer, in
key order). The Ray job that fills the parts is ``foreserve/batch/job.py``.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from app.api.errors import from_validation_error
from app.api.completions import CompletionRequest
from app.api.schemas import ChatCompletionRequest
from predictor.object_store import ObjectStore, object_at
from predictor.records import ChunkWriter, read_records

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SCHEMAS = {CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest}  # a line's url -> its body
STATUS_FILE = "status.json"  # a job's state and summary, in its output store
RESULTS_FILE = "results.jsonl"  # one answer per input line, in input order
FLUSH_ROWS = 8  # an engine stores its finished rows in chunks of at most this many rows...
FLUSH_S = 10.0  # ...or of those that finished within this many seconds, whichever comes first


@dataclass
class InputRow:
    """One input line: a request to run, or the error to answer it with."""

    line: int  # 1-based input line number: the row's identity (custom_ids may repeat or be missing)
    custom_id: str | None
    request: ChatCompletionRequest | CompletionRequest | None = None
    error: str | None = None


class BatchError(BaseModel):
    code: str
    message: str


class ResultRow(BaseModel):
    """One output line (OpenAI's batch output shape) plus foreserve's ``line`` and token counts."""

    id: str
    custom_id: str | None
    response: dict | None = Field(None, description="{status_code, request_id, body: a chat completion}")
    error: BatchError | None = None
    line: int
    predicted_tokens: int | None = None
    output_tokens: int | None = None


def _parse(line_no: int, text: str, seen: dict[str, int], default_model: str) -> InputRow:
    try:
        item = json.loads(text)
    except ValueError:
        return InputRow(line_no, None, error=f"line {line_no}: invalid JSON")
    if not isinstance(item, dict):
        return InputRow(line_no, None, error=f"line {line_no}: expected a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return InputRow(line_no, None, error=f"line {line_no}: missing custom_id")
    if custom_id in seen:
        return InputRow(line_no, custom_id, error=f"line {line_no}: custom_id {custom_id!r} already used on line {seen[custom_id]}")
    seen[custom_id] = line_no
    url = item.get("url", CHAT_URL)
    if item.get("method", "POST") != "POST" or url not in SCHEMAS:
        return InputRow(line_no, custom_id, error=f"line {line_no}: only POST {CHAT_URL} or {COMPLETIONS_URL} is supported")
    body = item.get("body")
    if isinstance(body, str):  # Parquet inputs often carry the body as a JSON string column
        try:
            body = json.loads(body)
        except ValueError:
            pass
    if not isinstance(body, dict):
        return InputRow(line_no, custom_id, error=f"line {line_no}: body must be a JSON object")
    try:
        request = SCHEMAS[url].model_validate({"model": default_model, **body})
    except ValidationError as exc:
        return InputRow(line_no, custom_id, error=f"line {line_no}: {from_validation_error(exc).message}")
    return InputRow(line_no, custom_id, request=request)


def _lines(key: str, data: bytes) -> Iterator[str]:
    if key.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        for row in pq.read_table(pa.BufferReader(data)).to_pylist():
            yield json.dumps(row)
        return
    yield from io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace")  # as open() splits lines


def _input_bytes(source: str | Path) -> tuple[str, bytes]:
    """The input's object key and bytes: a local file or one object of a store."""
    store, key = object_at(source)
    root = store.local_root
    if root is not None:
        path = root / key
        if not path.is_file():
            raise FileNotFoundError(f"batch input {path} does not exist or is not a file")
        if not os.access(path, os.R_OK):
            raise PermissionError(f"batch input {path} is not readable")
    try:
        return key, store.get(key)
    except FileNotFoundError:
        raise FileNotFoundError(f"batch input {source} does not exist or is not a file") from None


def read_input(source: str | Path, default_model: str) -> Iterator[InputRow]:
    """Every non-blank input line as an ``InputRow``; ``source`` is a local path or the URI of one
    object. An unreadable input fails at the first row, at once."""
    key, data = _input_bytes(source)
    seen: dict[str, int] = {}
    for line_no, text in enumerate(_lines(key, data), 1):
        if text.strip():
            yield _parse(line_no, text, seen, default_model)


def error_row(row: InputRow, code: str = "invalid_request") -> ResultRow:
    return ResultRow(id=f"batch_req_{row.line}", custom_id=row.custom_id, line=row.line,
                     error=BatchError(code=code, message=row.error or "failed"))


def ok_row(row: InputRow, completion: dict, predicted_tokens: int | None) -> ResultRow:
    return ResultRow(id=f"batch_req_{row.line}", custom_id=row.custom_id, line=row.line,
                     response={"status_code": 200, "request_id": completion["id"], "body": completion},
                     predicted_tokens=predicted_tokens, output_tokens=completion["usage"]["completion_tokens"])


class PartWriter:
    """A worker's finished rows into ``parts/`` as chunk objects of its own (``ChunkWriter``, each
    put before ``append`` returns). A chunk is stored once ``flush_rows`` rows wait or the oldest
    waiting row is ``flush_s`` seconds old (checked as rows arrive), and by ``flush``. A worker that
    dies loses the rows that wait, fewer than ``flush_rows``: the retried batch regenerates them."""

    def __init__(self, parts: ObjectStore, flush_rows: int = 1, flush_s: float = FLUSH_S) -> None:
        self.chunks = ChunkWriter(parts)
        self.flush_rows, self.flush_s = max(1, flush_rows), flush_s
        self.waiting: list[ResultRow] = []
        self.oldest = 0.0

    def append(self, row: ResultRow) -> None:
        self.append_many([row])

    def append_many(self, rows: Iterable[ResultRow]) -> None:
        rows = list(rows)
        if rows and not self.waiting:
            self.oldest = time.monotonic()
        self.waiting.extend(rows)
        if len(self.waiting) >= self.flush_rows or (self.waiting and time.monotonic() - self.oldest >= self.flush_s):
            self.flush()

    def flush(self) -> None:
        """Store every waiting row as one chunk."""
        if self.waiting:
            self.chunks.append_many(self.waiting)
            self.waiting = []


class ResultStore:
    """A job's output: a local folder or a store URI holding ``parts/`` (chunk objects from any
    number of workers on any nodes), ``status.json`` and ``results.jsonl``."""

    def __init__(self, out: str | Path | ObjectStore) -> None:
        self.objects = out if isinstance(out, ObjectStore) else ObjectStore(out)
        self.parts = self.objects.child("parts")

    @property
    def uri(self) -> str:
        return self.objects.uri

    def location(self, key: str) -> str:
        """Where object ``key`` is: a local path, or a URI ``object_at`` opens."""
        return self.objects.child(key).uri

    def writer(self, batch: str | None = None, flush_rows: int = 1, flush_s: float = FLUSH_S) -> PartWriter:
        """A ``PartWriter`` into ``parts/`` (``parts/<batch>/`` for one engine batch, whose retry
        reads only that folder). The default stores every ``append`` at once."""
        return PartWriter(self.parts.child(batch) if batch else self.parts, flush_rows, flush_s)

    def rows(self, batch: str | None = None) -> list[ResultRow]:
        """Every row the parts hold (under ``parts/<batch>/`` with ``batch``), in key order, a line
        answered twice included."""
        return read_records(self.parts.child(batch) if batch else self.parts, ResultRow)[0]

    def answered(self, batch: str | None = None) -> dict[int, ResultRow]:
        """The first answer of every input line some part holds (what a resumed job skips)."""
        first: dict[int, ResultRow] = {}
        for row in self.rows(batch):
            first.setdefault(row.line, row)  # NOTE: a row answered twice (a retried worker) counts once
        return first

    def done_lines(self, batch: str | None = None) -> set[int]:
        return set(self.answered(batch))

    def finalize(self, expected_lines: set[int] | None = None, answered: dict[int, ResultRow] | None = None) -> str:
        """Put ``results.jsonl``: one answer per input line, in input order; returns its location.
        With ``expected_lines`` (the non-blank input lines), fails unless each of them is answered.
        ``answered``: what ``answered()`` just returned, if the caller has it (saves a scan)."""
        first = self.answered() if answered is None else answered
        if expected_lines is not None:
            missing = sorted(expected_lines - set(first))
            if missing:
                raise RuntimeError(f"{len(missing)} input lines have no result yet (first: {missing[:5]})")
        self.objects.put(RESULTS_FILE, b"".join(first[line].model_dump_json().encode() + b"\n" for line in sorted(first)))
        return self.location(RESULTS_FILE)

    def results(self) -> list[dict]:
        """``results.jsonl``'s lines, parsed; FileNotFoundError before ``finalize``."""
        return [json.loads(line) for line in self.objects.get(RESULTS_FILE).splitlines() if line.strip()]

    def write_parquet(self) -> str:
        """Put ``results.parquet`` beside ``results.jsonl`` (bodies as JSON strings: their shape
        varies); returns its location."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self.results()
        for row in rows:
            for key in ("response", "error"):
                row[key] = None if row[key] is None else json.dumps(row[key])
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows), sink)
        self.objects.put("results.parquet", sink.getvalue().to_pybytes())
        return self.location("results.parquet")

    def status(self) -> dict:
        """``status.json`` as the driver last put it ({} before it did)."""
        try:
            return json.loads(self.objects.get(STATUS_FILE))
        except FileNotFoundError:
            return {}

    def write_status(self, **fields) -> None:
        """Update ``status.json`` with ``fields`` (put whole: readers see the old or the new one)."""
        status = self.status()
        status.update(fields, updated_at=time.time())
        self.objects.put(STATUS_FILE, json.dumps(status, indent=1).encode())


def write_status(out: str | Path, **fields) -> None:
    """Update the job's ``status.json`` (what ``foreserve batch status`` reads) in output ``out``."""
    ResultStore(out).write_status(**fields)


def read_status(out: str | Path) -> dict:
    """The job's status plus live progress counted from the parts (rows land there as they finish)."""
    store = ResultStore(out)
    status = store.status()
    answered = store.answered()
    status["rows_done"] = len(answered)
    status["rows_failed"] = sum(r.error is not None for r in answered.values())
    tokens = sum(r.output_tokens or 0 for r in answered.values()) - status.get("resumed_output_tokens", 0)
    started, ended = status.get("started_at"), status.get("finished_at") or time.time()
    if started and tokens > 0:
        status["output_tokens_per_s"] = round(tokens / max(ended - started, 1e-9), 2)
    return status
