"""OpenAI's Files and Batch API objects (``app/batch/api.py``) on the store, a local folder and a real
S3 server, with the Ray Jobs calls stubbed: uploads, records and job outputs are whole objects under
``batches/``, the job is handed the input's and output's URIs, two stores on the same URI (two
ingress replicas) see each other's files and batches; and how the Jobs client finds a cluster's
dashboard (``app/batch/jobs.py``)."""

from __future__ import annotations

import json
import shlex

import pytest

from app.api.errors import APIError
from app.batch import jobs
from app.batch.api import BatchCreate, BatchStore
from app.batch.io import InputRow, ResultStore, error_row, ok_row, read_status, write_status
from predictor.object_store import ObjectStore, object_at

ROW = b'{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}\n'
ROWS = ROW + b'{"custom_id": "b", "body": {"messages": [{"role": "user", "content": "yo"}]}}\n'
CHAT = "/v1/chat/completions"


class FakeJobs:
    """``jobs.submit``/``status``/``stop`` as one Ray cluster that every store's replica shares: the
    status of a job is its Ray state (set by the test) plus what its output holds (``read_status``)."""

    def __init__(self) -> None:
        self.submitted: dict[str, dict] = {}
        self.submissions: dict[str, int] = {}  # Ray jobs per batch job id
        self.state: dict[str, str] = {}
        self.exit_code: dict[str, int | None] = {}  # the last Ray job's driver's
        self.stopped: list[str] = []

    def submit(self, input_path, output, job_id, **kwargs) -> str:
        self.submitted[job_id] = {"input": input_path, "output": output, **kwargs}
        self.submissions[job_id] = self.submissions.get(job_id, 0) + 1
        self.state[job_id], self.exit_code[job_id] = "PENDING", None
        return job_id

    def status(self, job_id: str, client=None) -> dict:
        if job_id not in self.state:
            raise jobs.JobError(f"no batch job {job_id!r} in this Ray cluster")
        return {"ray_status": self.state[job_id], "message": None, "submissions": self.submissions[job_id],
                "driver_exit_code": self.exit_code[job_id], **read_status(self.submitted[job_id]["output"])}

    def stop(self, job_id: str, client=None) -> bool:
        self.stopped.append(job_id)
        return True


@pytest.fixture
def fake_jobs(monkeypatch: pytest.MonkeyPatch) -> FakeJobs:
    fake = FakeJobs()
    monkeypatch.setattr(jobs, "client", lambda *a, **k: object())
    monkeypatch.setattr(jobs, "submit", fake.submit)
    monkeypatch.setattr(jobs, "status", fake.status)
    monkeypatch.setattr(jobs, "stop", fake.stop)
    return fake


def _create(store: BatchStore, file_id: str) -> object:
    return store.create(BatchCreate(input_file_id=file_id, endpoint=CHAT, metadata={"k": "v"}))


def _error(call, *args) -> APIError:
    with pytest.raises(APIError) as exc:
        call(*args)
    return exc.value


def _finish(output: str, lines: int) -> None:
    """What a finished job leaves in its output: its rows' parts, results.jsonl and status.json."""
    completion = {"id": "chatcmpl-1", "object": "chat.completion", "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    rows = [ok_row(InputRow(1, "a"), completion, 8)] + [error_row(InputRow(n, None, error="bad")) for n in range(2, lines + 1)]
    results = ResultStore(output)
    results.writer().append_many(rows)
    results.finalize(set(range(1, lines + 1)))
    write_status(output, state="succeeded", rows_total=lines, started_at=100.0, finished_at=160.0)


def test_files_are_objects_under_batches(object_store: ObjectStore, fake_jobs: FakeJobs):
    store = BatchStore(object_store)
    file = store.add_file("rows.jsonl", ROWS, "batch")
    assert (file.bytes, file.filename, file.purpose, file.object) == (len(ROWS), "rows.jsonl", "batch", "file")
    assert object_store.keys() == [f"batches/files/{file.id}.json", f"batches/files/{file.id}.jsonl"]
    assert store.get_file(file.id) == file
    assert store.file_content(file.id) == ROWS
    assert store.add_file("", ROW, "batch").filename == "upload.jsonl"

    wrong = _error(store.add_file, "x.jsonl", ROW, "fine-tune")
    assert (wrong.status_code, wrong.param) == (400, "purpose")
    empty = _error(store.add_file, "x.jsonl", b" \n", "batch")
    assert (empty.status_code, empty.param) == (400, "file")
    for bad in ("file-nope", "../files/x", "files/x", ".hidden", ""):
        for call in (store.get_file, store.file_content):
            missing = _error(call, bad)
            assert missing.body() == {"error": {"message": f"No such File object: {bad}", "type": "invalid_request_error",
                                                "param": "file_id", "code": "not_found"}}


def test_create_hands_the_job_the_input_and_output_uris(object_store: ObjectStore, fake_jobs: FakeJobs):
    store = BatchStore(object_store, app_name="myapp", model={"model": "gemma-3-270m", "chat_template": "{{ x }}"})
    file = store.add_file("rows.jsonl", ROWS, "batch")
    batch = _create(store, file.id)
    assert batch.status == "validating" and batch.input_file_id == file.id and batch.metadata == {"k": "v"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    job = fake_jobs.submitted[batch.id]
    # the job reads its rows for the app's model (its tokenizer and template), not serve_config.yaml's
    served = '{"model": "gemma-3-270m", "chat_template": "{{ x }}"}'
    assert job == {"input": object_store.child("batches", "files", f"{file.id}.jsonl").uri,
                   "output": object_store.child("batches", batch.id).uri,
                   "backend": "serve", "extra_args": ["--app-name", "myapp", "--engine", served], "jobs": job["jobs"]}
    source, key = object_at(job["input"])  # what the job opens, on whichever node it runs
    assert source.get(key) == ROWS
    record = json.loads(object_store.get(f"batches/{batch.id}.json"))
    assert record["id"] == batch.id and record["input_file_id"] == file.id

    assert _error(store.create, BatchCreate(input_file_id=file.id, endpoint="/v1/embeddings")).param == "endpoint"
    window = _error(store.create, BatchCreate(input_file_id=file.id, endpoint=CHAT, completion_window="1h"))
    assert (window.status_code, window.param) == (400, "completion_window")
    missing = _error(store.create, BatchCreate(input_file_id="file-nope", endpoint=CHAT))
    assert (missing.status_code, missing.code, missing.message) == (404, "not_found", "No such File object: file-nope")
    assert list(fake_jobs.submitted) == [batch.id]


def test_get_list_and_cancel_follow_the_job(object_store: ObjectStore, fake_jobs: FakeJobs):
    store = BatchStore(object_store)
    file = store.add_file("rows.jsonl", ROWS, "batch")
    first, second, third = (_create(store, file.id) for _ in range(3))
    assert store.get(first.id).status == "validating"

    fake_jobs.state[first.id] = "RUNNING"
    write_status(fake_jobs.submitted[first.id]["output"], state="running", rows_total=2, started_at=100.0)
    running = store.get(first.id)
    assert running.status == "in_progress" and running.in_progress_at == 100 and running.request_counts.total == 2

    fake_jobs.state[first.id] = "SUCCEEDED"
    _finish(fake_jobs.submitted[first.id]["output"], 2)
    done = store.get(first.id)
    assert (done.status, done.completed_at, done.output_file_id) == ("completed", 160, f"file-{first.id}-output")
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (2, 1, 1)
    output = [json.loads(line) for line in store.file_content(done.output_file_id).splitlines()]
    assert [row["line"] for row in output] == [1, 2] and output[1]["error"]["message"] == "bad"
    out_file = store.get_file(done.output_file_id)
    assert out_file.purpose == "batch_output" and out_file.bytes == len(store.file_content(done.output_file_id))
    late = _error(store.cancel, first.id)
    assert (late.status_code, late.code) == (409, "batch_not_cancellable")

    fake_jobs.state[second.id] = "RUNNING"
    assert store.cancel(second.id).status == "cancelling" and fake_jobs.stopped == [second.id]
    fake_jobs.state[second.id] = "STOPPED"
    assert store.get(second.id).status == "cancelled"
    fake_jobs.state[third.id], fake_jobs.exit_code[third.id] = "FAILED", 1  # the job's own error
    assert store.get(third.id).status == "failed"

    # newest first by the records' created_at, though cancel rewrote the second record last
    listed = store.list()
    assert [b["id"] for b in listed["data"]] == [third.id, second.id, first.id]
    assert (listed["object"], listed["first_id"], listed["last_id"], listed["has_more"]) == ("list", third.id, first.id, False)
    assert [b["status"] for b in listed["data"]] == ["failed", "cancelled", "completed"]
    page = store.list(limit=2)
    assert [b["id"] for b in page["data"]] == [third.id, second.id] and page["has_more"]
    for bad in ("batch_nope", "../batch_x", ""):
        missing = _error(store.get, bad)
        assert missing.body()["error"] == {"message": f"No such Batch object: {bad}", "type": "invalid_request_error",
                                           "param": "batch_id", "code": "not_found"}
        assert _error(store.cancel, bad).status_code == 404
    assert BatchStore(object_store.child("elsewhere")).list()["data"] == []


def test_two_replicas_on_one_store_see_each_others_files_and_batches(object_store: ObjectStore, fake_jobs: FakeJobs):
    one, two = BatchStore(ObjectStore(object_store.uri)), BatchStore(ObjectStore(object_store.uri))
    file = one.add_file("rows.jsonl", ROW, "batch")
    assert two.get_file(file.id) == file and two.file_content(file.id) == ROW
    batch = _create(two, file.id)
    assert one.get(batch.id).id == batch.id and [b["id"] for b in one.list()["data"]] == [batch.id]
    fake_jobs.state[batch.id] = "RUNNING"
    assert one.cancel(batch.id).status == "cancelling"
    assert two.get(batch.id).status == "cancelling"
    fake_jobs.state[batch.id] = "SUCCEEDED"
    _finish(fake_jobs.submitted[batch.id]["output"], 1)
    output_id = two.get(batch.id).output_file_id
    assert one.get(batch.id).output_file_id == output_id and one.file_content(output_id) == two.file_content(output_id)


def test_a_batch_without_its_ray_job_loses_nothing(object_store: ObjectStore, fake_jobs: FakeJobs, monkeypatch):
    """A submit that fails leaves no batch behind (503); a batch whose Ray job is gone (the cluster
    restarted) reports what its job left in the store instead of failing the request."""
    store = BatchStore(object_store)
    file = store.add_file("in.jsonl", ROW, "batch")

    def refused(*_a, **_k):
        raise jobs.JobError("no dashboard")

    monkeypatch.setattr(jobs, "submit", refused)
    down = _error(_create, store, file.id)
    assert down.status_code == 503 and "no dashboard" in down.message
    assert not [k for k in object_store.keys() if k.startswith("batches/batch_")] and store.list()["data"] == []

    monkeypatch.setattr(jobs, "submit", fake_jobs.submit)
    done, lost = _create(store, file.id), _create(store, file.id)
    _finish(fake_jobs.submitted[done.id]["output"], 1)
    fake_jobs.state.clear()  # Ray knows neither job any more
    got = store.get(done.id)
    assert got.status == "completed" and got.output_file_id and got.request_counts.total == 1
    failed = store.get(lost.id)
    assert failed.status == "failed" and "cluster restarted" in failed.errors["data"][0]["message"]


def test_a_file_record_from_before_the_store_still_reads(tmp_path, fake_jobs: FakeJobs):
    """A data dir's older records name their content by local path; the local store reads them."""
    (tmp_path / "batches" / "files").mkdir(parents=True)
    (tmp_path / "old.jsonl").write_bytes(ROW)
    record = {"id": "file-old", "object": "file", "bytes": len(ROW), "created_at": 1, "filename": "old.jsonl",
              "purpose": "batch", "status": "processed", "path": str(tmp_path / "old.jsonl")}
    (tmp_path / "batches" / "files" / "file-old.json").write_text(json.dumps(record))
    store = BatchStore(ObjectStore(tmp_path))
    assert store.get_file("file-old").bytes == len(ROW) and store.file_content("file-old") == ROW
    assert fake_jobs.submitted[_create(store, "file-old").id]["input"] == str(tmp_path / "old.jsonl")


# -- the Jobs client: where a cluster's dashboard is, and inputs and outputs by URI -----------------
def test_a_dashboard_on_the_heads_loopback_is_the_heads_address_elsewhere():
    assert jobs.reachable_dashboard("127.0.0.1:8265", "10.0.0.1", "10.0.0.1") == "http://127.0.0.1:8265"  # on the head
    assert jobs.reachable_dashboard("127.0.0.1:8265", "10.0.0.1", "10.0.0.2") == "http://10.0.0.1:8265"
    assert jobs.reachable_dashboard("localhost:9000", "10.0.0.1", "10.0.0.2") == "http://10.0.0.1:9000"
    assert jobs.reachable_dashboard("10.0.0.1:8265", "10.0.0.1", "10.0.0.2") == "http://10.0.0.1:8265"
    assert jobs.reachable_dashboard("http://10.0.0.9:8265", "10.0.0.1", "10.0.0.2") == "http://10.0.0.9:8265"
    assert jobs.reachable_dashboard("[::1]:8265", "fd00::1", "fd00::2") == "http://[fd00::1]:8265"


def test_an_explicit_dashboard_url_wins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert jobs.dashboard_url() == "http://head:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://api:8265")
    assert jobs.dashboard_url() == "http://api:8265"
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # a cluster address: Ray's client resolves it
    monkeypatch.setattr(jobs, "_cluster_dashboard", lambda: None)  # (this process is no part of a cluster)
    assert jobs.dashboard_url() is None


class FakeClient:
    """The two calls ``jobs.submit`` makes of Ray's JobSubmissionClient."""

    def __init__(self) -> None:
        self.jobs: list[dict] = []

    def list_jobs(self) -> list:
        return []

    def submit_job(self, **kwargs) -> str:
        self.jobs.append(kwargs)
        return kwargs["submission_id"]


def test_submit_takes_store_uris_for_input_and_output(object_store: ObjectStore, tmp_path):
    object_store.put("in/rows.jsonl", ROWS)
    source, output = object_store.child("in", "rows.jsonl").uri, object_store.child("out", "job-1").uri
    client = FakeClient()
    assert jobs.submit(source, output, "job-1", backend="serve", jobs=client) == "job-1"
    (job,) = client.jobs
    assert job["metadata"] == {"job_id": "job-1", "output": output, "input": source}
    assert shlex.split(job["entrypoint"])[2:6] == ["foreserve.batch.job", source, "--output", output]
    assert not object_store.keys("out")  # the job writes its output; nothing is made beforehand
    with pytest.raises(FileNotFoundError):  # an input that is not there fails before any job exists
        jobs.submit(object_store.child("in", "nope.jsonl").uri, output, "job-2", jobs=client)
    assert len(client.jobs) == 1
    assert jobs.location(tmp_path / "a" / ".." / "b") == str(tmp_path / "b") and jobs.location(output) == output


class BusyHeadClient(FakeClient):
    """A head whose job agent has not registered yet: Ray's Jobs API answers 500 "No available agent"
    for the first ``busy`` submissions, as it does for a head under load at start."""

    def __init__(self, busy: int) -> None:
        super().__init__()
        self.busy, self.calls = busy, 0

    def submit_job(self, **kwargs) -> str:
        self.calls += 1
        if self.calls <= self.busy:
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, please try again later..")
        return super().submit_job(**kwargs)


def test_submit_waits_out_a_head_whose_job_agent_is_not_up_yet(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Ray asks to "try again later" while the head's job agent registers: submit does, within its
    limit, and submits once; past the limit it raises JobError naming the cause."""
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    source = tmp_path / "rows.jsonl"
    source.write_bytes(ROWS)
    client = BusyHeadClient(busy=3)
    assert jobs.submit(source, tmp_path / "out", "job-1", jobs=client) == "job-1"
    assert client.calls == 4 and [j["submission_id"] for j in client.jobs] == ["job-1"]
    never = BusyHeadClient(busy=10**6)
    with pytest.raises(jobs.JobError, match="job agent"):
        jobs.submit(source, tmp_path / "out", "job-2", jobs=never)
    assert never.jobs == [] and never.calls == jobs.AGENT_WAIT_TRIES
    other = RuntimeError("Request failed with status code 400: bad runtime_env.")
    broken = FakeClient()
    broken.submit_job = lambda **kw: (_ for _ in ()).throw(other)
    with pytest.raises(RuntimeError, match="bad runtime_env"):  # any other error is raised at once
        jobs.submit(source, tmp_path / "out", "job-3", jobs=broken)


def test_a_tenant_sees_only_its_own_files_and_batches(object_store: ObjectStore, fake_jobs: FakeJobs):
    """Owners are the callers' key digests: another key's files, contents, batches, cancels and
    listings are 404 or absent, as if they did not exist; without authentication (owner None) the
    store is one tenant."""
    store = BatchStore(object_store)
    a, b = "a" * 64, "b" * 64
    file = store.add_file("rows.jsonl", ROWS, "batch", owner=a)
    batch = store.create(BatchCreate(input_file_id=file.id, endpoint=CHAT), owner=a)
    assert store.get_file(file.id, owner=a) == file and store.get(batch.id, owner=a).id == batch.id
    for call, args, code in ((store.get_file, (file.id,), "not_found"), (store.file_content, (file.id,), "not_found"),
                             (store.get, (batch.id,), "not_found"), (store.cancel, (batch.id,), "not_found")):
        assert _error(lambda *x: call(*x, owner=b), *args).status_code == 404
    stolen = _error(lambda: store.create(BatchCreate(input_file_id=file.id, endpoint=CHAT), owner=b))
    assert (stolen.status_code, stolen.param) == (404, "file_id") and len(fake_jobs.submitted) == 1
    assert store.list(owner=b)["data"] == [] and [x["id"] for x in store.list(owner=a)["data"]] == [batch.id]
    assert fake_jobs.stopped == []

    fake_jobs.state[batch.id] = "SUCCEEDED"
    _finish(fake_jobs.submitted[batch.id]["output"], 2)
    output_id = store.get(batch.id, owner=a).output_file_id
    assert store.file_content(output_id, owner=a).count(b"\n") == 2
    assert _error(lambda: store.file_content(output_id, owner=b)).status_code == 404
    assert "owner" not in store.get(batch.id, owner=a).model_dump() and "owner" not in file.model_dump()
    assert [x["id"] for x in store.list()["data"]] == [batch.id] and store.get_file(file.id) == file  # no auth: one tenant


def test_a_batch_whose_job_was_lost_is_submitted_again_and_one_that_failed_by_itself_is_not(
        object_store: ObjectStore, fake_jobs: FakeJobs, monkeypatch: pytest.MonkeyPatch):
    store = BatchStore(object_store)
    file = store.add_file("in.jsonl", ROWS, "batch")
    batch = _create(store, file.id)
    first = dict(fake_jobs.submitted[batch.id])
    for submissions in range(2, jobs.SUBMISSIONS + 1):  # its driver killed (sh reports 137), again and again
        fake_jobs.state[batch.id], fake_jobs.exit_code[batch.id] = "FAILED", 137
        assert store.get(batch.id).status == "validating"  # submitted again, pending
        assert fake_jobs.submissions[batch.id] == submissions and fake_jobs.submitted[batch.id] == first  # same input, output
    fake_jobs.state[batch.id], fake_jobs.exit_code[batch.id] = "FAILED", -9
    monkeypatch.setattr(fake_jobs, "status", lambda job_id, client=None: {**FakeJobs.status(fake_jobs, job_id), "message": (
        "Job entrypoint command failed with exit code -9, last available logs (truncated to 20,000 chars):\n"
        "(ServeStage pid=23593) WARNING ... /root/.cache/ray ...")})
    monkeypatch.setattr(jobs, "status", fake_jobs.status)
    failed = store.get(batch.id)
    assert failed.status == "failed"  # no more than SUBMISSIONS Ray jobs for one batch
    assert fake_jobs.submissions[batch.id] == jobs.SUBMISSIONS
    # why, in one line: not the driver's log that Ray appends (pids, paths)
    assert failed.errors["data"] == [{"code": "job_failed", "message": "Job entrypoint command failed with exit code -9"}]

    own = _create(store, file.id)  # the job failed by itself (exit code 1): failed at once, in get and in list
    fake_jobs.state[own.id], fake_jobs.exit_code[own.id] = "FAILED", 1
    assert store.get(own.id).status == "failed" and store.list()["data"][0]["status"] == "failed"
    assert fake_jobs.submissions[own.id] == 1

    gone = _create(store, file.id)  # its supervisor died with its node: no exit code; list resubmits it too
    fake_jobs.state[gone.id] = "FAILED"
    assert store.list()["data"][0]["status"] == "validating" and fake_jobs.submissions[gone.id] == 2


def test_only_a_driver_killed_or_gone_is_a_lost_job():
    assert jobs.lost({"ray_status": "FAILED", "driver_exit_code": -9})
    assert jobs.lost({"ray_status": "FAILED", "driver_exit_code": 137})  # sh -c, its python killed by SIGKILL
    assert jobs.lost({"ray_status": "FAILED", "driver_exit_code": None})  # no driver exit: its supervisor is gone
    assert not jobs.lost({"ray_status": "FAILED", "driver_exit_code": 1})  # the job's own error
    assert not jobs.lost({"ray_status": "FAILED", "driver_exit_code": 2})  # bad arguments
    assert not jobs.lost({"ray_status": "STOPPED", "driver_exit_code": None})  # cancelled
    assert not jobs.lost({"ray_status": "RUNNING", "driver_exit_code": None})
