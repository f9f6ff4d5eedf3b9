"""OpenAI's Files and Batch API objects, backed by foreserve batch jobs (``app/batch/jobs.py``).

All state is whole objects under the ``batches/`` prefix of foreserve's store (``app.paths.store``:
a local folder on one machine, or a URI such as ``s3://…`` that every node sees), so any ingress
replica on any node answers for any file or batch:

- ``files/<file id>.jsonl``: an uploaded file's content; ``files/<file id>.json``: its record (the
  ``FileObject`` plus ``key``, where its content is, relative to ``batches/``);
- ``<batch id>.json``: a batch's record;
- ``<batch id>/``: the batch job's output (``status.json``, ``parts/``, ``results.jsonl``).

A batch is a Ray Job whose id is the batch id; the job is handed the input object's URI and its
output prefix's URI, and reads and writes them through the store itself. A batch's state is read
from Ray and the job's own progress each time it is asked for, so nothing here can drift from what
the job did. A job lost under the batch (its driver killed, its node gone: ``jobs.lost``) is
submitted again under the batch's id when the batch is next read, up to ``jobs.SUBMISSIONS`` Ray
jobs in all; it resumes from the rows already written, and writes none twice. The output file (one
line per input line, errors included) gets a file id once the job has finished.

Every record names its ``owner``: the digest of the API key that created it (the batch's, for its
output file). A caller sees only its own: another key's file or batch is a 404, as if it did not
exist, and ``list`` leaves it out. Without API keys (owner None) the store is one tenant.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.api import errors
from app.batch import jobs
from app.batch.io import CHAT_URL, SCHEMAS, read_status
from predictor.object_store import ObjectStore

logger = logging.getLogger(__name__)
WINDOW_S = 24 * 3600
RESULTS = "results.jsonl"  # the results object in a job's output (app/batch/io.py)


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class BatchCreate(BaseModel):
    model_config = ConfigDict(strict=True)

    input_file_id: str
    endpoint: str = Field(description=f"{CHAT_URL} or /v1/completions")
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
    """Files and batches under ``store``'s ``batches/`` prefix (module docstring). ``app_name`` is the
    Serve app whose offline pool runs the jobs; ``model`` its settings (model, served_model_name,
    chat_template) that a job's driver and stages read the rows with. Instances on any node given the
    same store see the same files and batches; every object is put whole, so a reader never sees half of one."""

    def __init__(self, store: ObjectStore | str | Path, app_name: str = "foreserve", model: dict | None = None) -> None:
        store = store if isinstance(store, ObjectStore) else ObjectStore(store)
        self.store = store.child("batches")
        self.app_name = app_name
        self.model = model or {}
        self._jobs = None

    def jobs(self):
        if self._jobs is None:
            try:
                self._jobs = jobs.client(start=False)
            except jobs.JobError as exc:
                raise errors.unavailable(f"Batch jobs need the Ray Jobs API (the cluster's dashboard): {exc}") from None
        return self._jobs

    def _read(self, key: str, missing: errors.APIError) -> dict:
        try:
            return json.loads(self.store.get(key))
        except FileNotFoundError:
            raise missing from None

    def _put(self, key: str, record: dict) -> None:
        self.store.put(key, json.dumps(record, indent=1).encode())

    # -- files -----------------------------------------------------------------------------
    def add_file(self, filename: str, content: bytes, purpose: str, owner: str | None = None) -> FileObject:
        if purpose != "batch":
            raise errors.bad_request(f"purpose must be 'batch' (got {purpose!r})", param="purpose")
        if not content.strip():
            raise errors.bad_request("The file is empty.", param="file")
        file = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=len(content), created_at=int(time.time()),
                          filename=filename or "upload.jsonl", purpose=purpose)
        key = f"files/{file.id}.jsonl"
        self.store.put(key, content)  # NOTE: the content first, so every record names content that exists
        self._put(f"files/{file.id}.json", {**file.model_dump(), "key": key, "owner": owner})
        return file

    def _file_record(self, file_id: str, owner: str | None) -> dict:
        if not _plain(file_id):
            raise _no_file(file_id)
        record = self._read(f"files/{file_id}.json", _no_file(file_id))
        if not _visible(record, owner):
            raise _no_file(file_id)
        return record

    def get_file(self, file_id: str, owner: str | None = None) -> FileObject:
        return FileObject.model_validate(self._file_record(file_id, owner))  # NOTE: `key` and `owner` are left out

    def _content_location(self, record: dict) -> str:
        """Where a file's content is: the URI (or local path) of its object."""
        if "key" in record:
            return self.store.child(record["key"]).uri
        return record["path"]  # NOTE: a record from before the store: a local path

    def file_content(self, file_id: str, owner: str | None = None) -> bytes:
        """A file's content (an upload, or a finished batch's output); 404 if there is none."""
        record = self._file_record(file_id, owner)
        try:
            return self.store.get(record["key"]) if "key" in record else Path(record["path"]).read_bytes()
        except FileNotFoundError:
            raise _no_file(file_id) from None

    # -- batches ---------------------------------------------------------------------------
    def _record(self, batch_id: str, owner: str | None) -> dict:
        missing = errors.APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        if not _plain(batch_id):
            raise missing
        record = self._read(f"{batch_id}.json", missing)
        if not _visible(record, owner):
            raise missing
        return record

    def output_uri(self, batch_id: str) -> str:
        """Where batch ``batch_id``'s job writes its output (a local path or a store URI)."""
        return self.store.child(batch_id).uri

    def create(self, request: BatchCreate, owner: str | None = None) -> Batch:
        if request.endpoint not in SCHEMAS:
            raise errors.bad_request(f"Only {' and '.join(SCHEMAS)} are supported as batch endpoints.", param="endpoint")
        if request.completion_window != "24h":
            raise errors.bad_request("completion_window must be '24h'.", param="completion_window")
        now_ns = time.time_ns()
        now = now_ns // 1_000_000_000
        batch = Batch(id=f"batch_{uuid.uuid4().hex}", endpoint=request.endpoint, input_file_id=request.input_file_id,
                      completion_window=request.completion_window, status="validating", created_at=now,
                      expires_at=now + WINDOW_S, metadata=request.metadata)
        try:  # NOTE: the record is written once the job exists, so no batch is left without one
            self._submit(batch.id, request.input_file_id, owner)
        except FileNotFoundError:  # NOTE: a record whose content is gone
            raise _no_file(request.input_file_id) from None
        except jobs.JobError as exc:
            raise errors.unavailable(f"The batch job could not be submitted: {exc}") from None
        # NOTE: created_ns orders batches created within the same second (list)
        self._put(f"{batch.id}.json", {**batch.model_dump(), "created_ns": now_ns, "owner": owner})
        return batch

    def _submit(self, batch_id: str, input_file_id: str, owner: str | None) -> None:
        source = self._content_location(self._file_record(input_file_id, owner))
        extra = ["--app-name", self.app_name, "--engine", json.dumps(self.model)]  # the served model, not the file's
        jobs.submit(source, self.output_uri(batch_id), batch_id, backend="serve", extra_args=extra, jobs=self.jobs())

    def _state(self, record: dict) -> Batch:
        """The batch of ``record`` as it is now; its job submitted again first if it was lost."""
        report = self._report(record["id"])
        if jobs.lost(report) and report.get("submissions", jobs.SUBMISSIONS) < jobs.SUBMISSIONS:
            try:
                self._submit(record["id"], record["input_file_id"], record.get("owner"))
                logger.warning("batch %s: its job was lost (%s); submitted again", record["id"], report.get("message"))
            except (RuntimeError, FileNotFoundError, errors.APIError) as exc:  # e.g. another replica was first
                logger.warning("batch %s: its lost job was not submitted again: %s", record["id"], exc)
            report = self._report(record["id"])
        return self._with_state(Batch.model_validate(record), report, record.get("owner"))

    def _report(self, batch_id: str) -> dict:
        """The Ray job's state and the job's progress; when Ray no longer knows the job (its
        cluster restarted), what the job left in the store: completed if it finished, else failed."""
        try:
            return jobs.status(batch_id, self.jobs())
        except jobs.JobError:
            report = read_status(self.output_uri(batch_id))
            finished = report.get("state") == "succeeded" and self.store.exists(f"{batch_id}/{RESULTS}")
            message = "the batch's Ray job is gone (the cluster restarted before it finished); create the batch again"
            return {**report, "ray_status": "SUCCEEDED" if finished else "FAILED", "message": message}

    def get(self, batch_id: str, owner: str | None = None) -> Batch:
        return self._state(self._record(batch_id, owner))

    def _with_state(self, batch: Batch, report: dict, owner: str | None) -> Batch:
        state = report["ray_status"]
        batch.request_counts = RequestCounts(total=report.get("rows_total", 0), failed=report.get("rows_failed", 0),
                                             completed=report.get("rows_done", 0) - report.get("rows_failed", 0))
        batch.in_progress_at = _int(report.get("started_at"))
        ended = _int(report.get("finished_at")) or int(time.time())
        if state == "SUCCEEDED":
            batch.status, batch.completed_at = "completed", ended
            batch.output_file_id = self._output_file(batch.id, owner)
        elif state == "FAILED":
            batch.status, batch.failed_at = "failed", ended
            batch.errors = {"object": "list", "data": [{"code": "job_failed", "message": _reason(report.get("message"))}]}
        elif state == "STOPPED":
            batch.status, batch.cancelled_at = "cancelled", ended
        elif batch.cancelling_at:
            batch.status = "cancelling"
        elif state == "RUNNING" and report.get("rows_total"):
            done = report.get("rows_done", 0) >= report["rows_total"]
            batch.status = "finalizing" if done else "in_progress"
        return batch

    def _output_file(self, batch_id: str, owner: str | None) -> str | None:
        """The output file's id, its record (the batch's owner's) put on first ask; None while there
        are no results."""
        file_id = f"file-{batch_id}-output"
        if not self.store.exists(f"files/{file_id}.json"):
            key = f"{batch_id}/{RESULTS}"
            try:
                size = self.store.size(key)
            except FileNotFoundError:
                return None
            file = FileObject(id=file_id, bytes=size, created_at=int(time.time()),
                              filename=f"{batch_id}_output.jsonl", purpose="batch_output")
            self._put(f"files/{file_id}.json", {**file.model_dump(), "key": key, "owner": owner})  # NOTE: any replica may: same record
        return file_id

    def cancel(self, batch_id: str, owner: str | None = None) -> Batch:
        record = self._record(batch_id, owner)
        batch = self.get(batch_id, owner)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            raise errors.APIError(409, f"Batch {batch_id} is already {batch.status}.", code="batch_not_cancellable")
        jobs.stop(batch_id, self.jobs())
        record["cancelling_at"] = int(time.time())
        self._put(f"{batch_id}.json", record)
        return self.get(batch_id, owner)

    def list(self, limit: int = 20, owner: str | None = None) -> dict:
        """The owner's newest ``limit`` batches first, by ``created_at`` in their records."""
        keys = [k for k in self.store.keys() if "/" not in k and k.startswith("batch_") and k.endswith(".json")]
        records = []
        for key in keys:
            try:
                record = json.loads(self.store.get(key))
            except FileNotFoundError:
                continue
            if _visible(record, owner):
                records.append(record)
        records.sort(key=lambda r: (r["created_at"], r.get("created_ns", 0), r["id"]), reverse=True)
        data = [self._state(r).model_dump() for r in records[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(records) > limit}


def _no_file(file_id: str) -> errors.APIError:
    return errors.APIError(404, f"No such File object: {file_id}", param="file_id", code="not_found")


def _visible(record: dict, owner: str | None) -> bool:
    """Whether a caller whose tenant is ``owner`` may see ``record``. Without authentication (None)
    the store is one tenant; a record from before tenants (no owner) is everyone's."""
    return owner is None or record.get("owner") in (None, owner)


def _plain(name: str) -> bool:
    """Whether ``name`` can be an object id: one key part, not hidden (no ``/``, no leading ``.``)."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _reason(message: str | None) -> str | None:
    """Why a job failed, in one line: Ray's message without the tail of the driver's log it appends
    (Ray's internals, pids and paths are nothing a client should read)."""
    if not message:
        return message
    return message.split(", last available logs")[0].splitlines()[0]


def _int(value) -> int | None:
    return None if value is None else int(value)
