"""Offline batch jobs' input and output, in OpenAI's Batch API line format, exactly once.

Input: JSONL (or Parquet) lines ``{"custom_id", "method": "POST", "url": "/v1/chat/completions",
"body": {...}}``. A bad line (invalid JSON, no custom_id, a custom_id seen before, a bad body)
becomes an error row, never a failed job; the first occurrence of a duplicated custom_id is still
answered. A body without ``model`` uses the served model.

Output: every worker appends finished rows to a part file of its own (``parts/``, one
``os.write`` per line, fsync'd: a crash loses at most a partial last line, which readers skip).
Rows are keyed by their input line number, so a resumed job skips what any part already holds,
and ``finalize`` writes ``results.jsonl`` with exactly one line per input line, in input order.
The Ray Data job that fills the parts is ``foreserve/batch/job.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from app.api.errors import from_validation_error
from app.api.schemas import ChatCompletionRequest
from predictor.feedback import FeedbackWriter
from predictor.records import read_records

CHAT_URL = "/v1/chat/completions"
STATUS_FILE = "status.json"  # a job's state and summary, in its output directory


@dataclass
class InputRow:
    """One input line: a request to run, or the error to answer it with."""

    line: int  # 1-based input line number: the row's identity (custom_ids may repeat or be missing)
    custom_id: str | None
    request: ChatCompletionRequest | None = None
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
    if item.get("method", "POST") != "POST" or item.get("url", CHAT_URL) != CHAT_URL:
        return InputRow(line_no, custom_id, error=f"line {line_no}: only POST {CHAT_URL} is supported")
    body = item.get("body")
    if isinstance(body, str):  # Parquet inputs often carry the body as a JSON string column
        try:
            body = json.loads(body)
        except ValueError:
            pass
    if not isinstance(body, dict):
        return InputRow(line_no, custom_id, error=f"line {line_no}: body must be a JSON object")
    try:
        request = ChatCompletionRequest.model_validate({"model": default_model, **body})
    except ValidationError as exc:
        return InputRow(line_no, custom_id, error=f"line {line_no}: {from_validation_error(exc).message}")
    return InputRow(line_no, custom_id, request=request)


def _lines(path: Path) -> Iterator[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for row in pq.read_table(path).to_pylist():
            yield json.dumps(row)
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for text in f:
            yield text


def read_input(path: str | Path, default_model: str) -> Iterator[InputRow]:
    """Every non-blank input line as an ``InputRow``. An unreadable file fails here, at once."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"batch input {path} does not exist or is not a file")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"batch input {path} is not readable")
    seen: dict[str, int] = {}
    for line_no, text in enumerate(_lines(path), 1):
        if text.strip():
            yield _parse(line_no, text, seen, default_model)


def write_json(path: Path, data: dict) -> None:
    """Replace ``path`` with ``data`` as JSON atomically (readers see the old or the new file)."""
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def error_row(row: InputRow, code: str = "invalid_request") -> ResultRow:
    return ResultRow(id=f"batch_req_{row.line}", custom_id=row.custom_id, line=row.line,
                     error=BatchError(code=code, message=row.error or "failed"))


def ok_row(row: InputRow, completion: dict, predicted_tokens: int | None) -> ResultRow:
    return ResultRow(id=f"batch_req_{row.line}", custom_id=row.custom_id, line=row.line,
                     response={"status_code": 200, "request_id": completion["id"], "body": completion},
                     predicted_tokens=predicted_tokens, output_tokens=completion["usage"]["completion_tokens"])


class ResultStore:
    """A job's output directory: ``parts/`` (appended by any number of workers) and ``results.jsonl``."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.parts = self.out_dir / "parts"

    def writer(self) -> FeedbackWriter:
        # NOTE: the feedback store's per-process append-only writer works for any pydantic row
        return FeedbackWriter(self.parts)

    def answered(self) -> dict[int, ResultRow]:
        """The first answer of every input line some part holds (what a resumed job skips)."""
        first: dict[int, ResultRow] = {}
        for row in read_records(self.parts, ResultRow)[0]:
            first.setdefault(row.line, row)  # NOTE: a row answered twice (a retried worker) counts once
        return first

    def done_lines(self) -> set[int]:
        return set(self.answered())

    def finalize(self, expected_lines: set[int] | None = None, answered: dict[int, ResultRow] | None = None) -> Path:
        """Write ``results.jsonl``: one answer per input line, in input order. With
        ``expected_lines`` (the non-blank input lines), fails unless each of them is answered.
        ``answered``: what ``answered()`` just returned, if the caller has it (saves a scan)."""
        first = self.answered() if answered is None else answered
        if expected_lines is not None:
            missing = sorted(expected_lines - set(first))
            if missing:
                raise RuntimeError(f"{len(missing)} input lines have no result yet (first: {missing[:5]})")
        out = self.out_dir / "results.jsonl"
        tmp = out.with_suffix(".jsonl.partial")
        with open(tmp, "w", encoding="utf-8") as f:
            for line in sorted(first):
                f.write(first[line].model_dump_json() + "\n")
        tmp.replace(out)
        return out


def write_status(out_dir: Path, **fields) -> None:
    """``status.json`` in the output directory (what ``foreserve batch status`` reads), replaced atomically."""
    path = Path(out_dir) / STATUS_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(fields, updated_at=time.time())
    write_json(path, old)


def read_status(out_dir: str | Path) -> dict:
    """The job's status plus live progress counted from the part files (rows land there as they finish)."""
    out_dir = Path(out_dir)
    path = out_dir / STATUS_FILE
    status = json.loads(path.read_text()) if path.is_file() else {}
    answered = ResultStore(out_dir).answered()
    status["rows_done"] = len(answered)
    status["rows_failed"] = sum(r.error is not None for r in answered.values())
    tokens = sum(r.output_tokens or 0 for r in answered.values()) - status.get("resumed_output_tokens", 0)
    started, ended = status.get("started_at"), status.get("finished_at") or time.time()
    if started and tokens > 0:
        status["output_tokens_per_s"] = round(tokens / max(ended - started, 1e-9), 2)
    return status
