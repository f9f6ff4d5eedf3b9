"""OpenAI's Files and Batch API objects, backed by foreserve batch jobs (``app/batch/jobs.py``).

Files live under ``<data dir>/batches/files`` (content plus a JSON record); a batch is a Ray Job
whose id is the batch id and whose output directory is ``<data dir>/batches/<batch id>``. A batch's
state is read from Ray and the job's own progress each time it is asked for, so nothing here can
drift from what the job did. The output file (one line per input line, errors included) gets a file
id once the job has finished.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from app.batch import jobs
from app.api import errors
from app.batch.io import CHAT_URL, read_status, write_json

WINDOW_S = 24 * 3600


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: str = Field(description=f"only {CHAT_URL}")
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchStore:
    """Files and batches of one data dir. ``app_name`` is the Serve app whose offline pool runs the jobs."""

    def __init__(self, root: Path, app_name: str = "foreserve") -> None:
        self.root = root
        self.files = self.root / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self.app_name = app_name
        self._jobs = None

    def jobs(self):
        if self._jobs is None:
            try:
                self._jobs = jobs.client(start=False)
            except jobs.JobError as exc:
                raise errors.unavailable(f"Batch jobs need the Ray Jobs API (the cluster's dashboard): {exc}") from None
        return self._jobs

    # -- files -----------------------------------------------------------------------------
    def add_file(self, filename: str, content: bytes, purpose: str) -> FileObject:
        if purpose != "batch":
            raise errors.bad_request(f"purpose must be 'batch' (got {purpose!r})", param="purpose")
        if not content.strip():
            raise errors.bad_request("The file is empty.", param="file")
        file = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=len(content), created_at=int(time.time()),
                          filename=filename or "upload.jsonl", purpose=purpose)
        (self.files / f"{file.id}.jsonl").write_bytes(content)
        write_json(self.files / f"{file.id}.json", {**file.model_dump(), "path": str(self.files / f"{file.id}.jsonl")})
        return file

    def _file_record(self, file_id: str) -> dict:
        path = self.files / f"{Path(file_id).name}.json"
        if not path.is_file():
            raise errors.APIError(404, f"No such File object: {file_id}", param="file_id", code="not_found")
        return json.loads(path.read_text())

    def get_file(self, file_id: str) -> FileObject:
        return FileObject.model_validate({k: v for k, v in self._file_record(file_id).items() if k != "path"})

    def file_content(self, file_id: str) -> Path:
        return Path(self._file_record(file_id)["path"])

    # -- batches ---------------------------------------------------------------------------
    def _record_path(self, batch_id: str) -> Path:
        return self.root / f"{Path(batch_id).name}.json"

    def _record(self, batch_id: str) -> dict:
        path = self._record_path(batch_id)
        if not path.is_file():
            raise errors.APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        return json.loads(path.read_text())

    def create(self, request: BatchCreate) -> Batch:
        if request.endpoint != CHAT_URL:
            raise errors.bad_request(f"Only {CHAT_URL} is supported as a batch endpoint.", param="endpoint")
        if request.completion_window != "24h":
            raise errors.bad_request("completion_window must be '24h'.", param="completion_window")
        source = self.file_content(request.input_file_id)
        now = int(time.time())
        batch = Batch(id=f"batch_{uuid.uuid4().hex}", endpoint=request.endpoint, input_file_id=request.input_file_id,
                      completion_window=request.completion_window, status="validating", created_at=now,
                      expires_at=now + WINDOW_S, metadata=request.metadata)
        try:  # NOTE: the record is written once the job exists, so no batch is left without one
            jobs.submit(source, self.root / batch.id, batch.id, backend="serve", extra_args=["--app-name", self.app_name],
                        jobs=self.jobs())
        except jobs.JobError as exc:
            raise errors.unavailable(f"The batch job could not be submitted: {exc}") from None
        write_json(self._record_path(batch.id), batch.model_dump())
        return batch

    def _report(self, batch_id: str) -> dict:
        """The Ray job's state and the job's progress; when Ray no longer knows the job (its
        cluster restarted), what the job left on disk: completed if it finished, else failed."""
        try:
            return jobs.status(batch_id, self.jobs())
        except jobs.JobError:
            report = read_status(self.root / batch_id)
            finished = report.get("state") == "succeeded" and (self.root / batch_id / "results.jsonl").is_file()
            message = "the batch's Ray job is gone (the cluster restarted before it finished); create the batch again"
            return {**report, "ray_status": "SUCCEEDED" if finished else "FAILED", "message": message}

    def get(self, batch_id: str) -> Batch:
        batch = Batch.model_validate(self._record(batch_id))
        report = self._report(batch_id)
        state = report["ray_status"]
        batch.request_counts = RequestCounts(total=report.get("rows_total", 0), failed=report.get("rows_failed", 0),
                                             completed=report.get("rows_done", 0) - report.get("rows_failed", 0))
        batch.in_progress_at = _int(report.get("started_at"))
        ended = _int(report.get("finished_at")) or int(time.time())
        if state == "SUCCEEDED":
            batch.status, batch.completed_at = "completed", ended
            batch.output_file_id = self._output_file(batch.id)
        elif state == "FAILED":
            batch.status, batch.failed_at = "failed", ended
            batch.errors = {"object": "list", "data": [{"code": "job_failed", "message": report.get("message")}]}
        elif state == "STOPPED":
            batch.status, batch.cancelled_at = "cancelled", ended
        elif batch.cancelling_at:
            batch.status = "cancelling"
        elif state == "RUNNING" and report.get("rows_total"):
            done = report.get("rows_done", 0) >= report["rows_total"]
            batch.status = "finalizing" if done else "in_progress"
        return batch

    def _output_file(self, batch_id: str) -> str:
        file_id = f"file-{batch_id}-output"
        record = self.files / f"{file_id}.json"
        if not record.is_file():
            results = self.root / batch_id / "results.jsonl"
            file = FileObject(id=file_id, bytes=results.stat().st_size, created_at=int(time.time()),
                              filename=f"{batch_id}_output.jsonl", purpose="batch_output")
            write_json(record, {**file.model_dump(), "path": str(results)})
        return file_id

    def cancel(self, batch_id: str) -> Batch:
        record = self._record(batch_id)
        batch = self.get(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            raise errors.APIError(409, f"Batch {batch_id} is already {batch.status}.", code="batch_not_cancellable")
        jobs.stop(batch_id, self.jobs())
        record["cancelling_at"] = int(time.time())
        write_json(self._record_path(batch_id), record)
        return self.get(batch_id)

    def list(self, limit: int = 20) -> dict:
        records = sorted(self.root.glob("batch_*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[:limit]
        data = [self.get(p.stem).model_dump() for p in records]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}


def _int(value) -> int | None:
    return None if value is None else int(value)
