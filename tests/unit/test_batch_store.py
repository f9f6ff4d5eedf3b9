"""A batch job's state in the store, on a local folder and on a real S3-compatible server: parts in
chunks from several writers, the first answer of a line wins, ``results.jsonl`` one line per input
line in input order, ``status.json`` and its live counts, input read by URI; and, without Ray, how
the driver pins the predictor and gives up on an actor no node takes."""

from __future__ import annotations

import json
import time

import pytest

from app.batch.io import InputRow, ResultStore, error_row, ok_row, read_input, read_status, write_status
from predictor.object_store import ObjectStore, object_at

MODEL = "SmolLM2-135M-Instruct"


def _ok(line: int, tokens: int, custom_id: str | None = None):
    completion = {"id": f"chatcmpl-{line}-{tokens}", "object": "chat.completion",
                  "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}}
    return ok_row(InputRow(line, custom_id or f"c{line}"), completion, predicted_tokens=102)


def _request(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], **body}}


def test_chunks_from_several_writers_first_answer_wins(object_store: ObjectStore):
    store = ResultStore(object_store)
    a = store.writer("a", flush_rows=3)  # two engine batches, each with its own folder under parts/
    b = store.writer("b", flush_rows=3)
    a.append_many([_ok(1, 4), _ok(2, 5)])
    assert store.done_lines() == set() and len(a.waiting) == 2  # fewer than flush_rows rows wait
    a.append(_ok(3, 6))  # the third row stores the chunk
    b.append_many([_ok(1, 40), _ok(4, 7)])
    b.flush()
    store.writer().append(error_row(InputRow(5, None, error="line 5: invalid JSON")))  # the driver's, stored at once
    assert [k.split("/")[0] for k in store.parts.keys()] == ["a", "b", next(k for k in store.parts.keys() if "/" not in k)]
    assert all(k.endswith(".jsonl") for k in store.parts.keys())
    assert store.done_lines("a") == {1, 2, 3} and store.done_lines("b") == {1, 4}  # what a retried batch skips
    assert store.done_lines() == {1, 2, 3, 4, 5}
    assert len(store.rows()) == 6  # line 1 answered twice in the parts...
    assert store.answered()[1].output_tokens == 4  # ...and the first answer, in key order, wins

    a.append(_ok(6, 1))
    a.append(_ok(6, 2))  # one writer answering a line twice: its earlier chunk wins
    a.flush()
    assert store.answered("a")[6].output_tokens == 1


def test_a_chunk_is_stored_after_flush_s_seconds(object_store: ObjectStore):
    store = ResultStore(object_store)
    writer = store.writer("x", flush_rows=100, flush_s=0.0)  # no row waits
    writer.append(_ok(1, 3))
    assert store.done_lines() == {1} and writer.waiting == []


def test_finalize_one_line_per_input_line_in_input_order(object_store: ObjectStore):
    store = ResultStore(object_store)
    writer = store.writer("b1")
    writer.append_many([_ok(3, 9), _ok(1, 4), _ok(3, 8)])
    with pytest.raises(RuntimeError, match="1 input lines have no result yet \\(first: \\[2\\]\\)"):
        store.finalize({1, 2, 3})
    with pytest.raises(FileNotFoundError):
        store.results()  # nothing put yet
    store.writer("b2").append(error_row(InputRow(2, None, error="line 2: invalid JSON")))
    where = store.finalize({1, 2, 3})
    assert where == object_store.child("results.jsonl").uri
    lines = store.results()
    assert [x["line"] for x in lines] == [1, 2, 3]
    assert lines[2]["output_tokens"] == 9 and lines[1]["error"]["message"] == "line 2: invalid JSON"
    owner, key = object_at(where)
    assert owner.get(key).count(b"\n") == 3  # the URI it returns opens the same object


def test_status_is_put_whole_and_counts_rows_from_the_parts(object_store: ObjectStore):
    assert read_status(object_store.uri) == {"rows_done": 0, "rows_failed": 0}
    started = time.time() - 5
    write_status(object_store.uri, state="running", rows_total=4, started_at=started, resumed_output_tokens=4)
    write_status(object_store.uri, predictor="champion", predictor_version="7")  # fields are merged
    store = ResultStore(object_store.uri)
    store.writer("b").append_many([_ok(1, 4), _ok(1, 99), _ok(2, 10), error_row(InputRow(3, None, error="x"))])
    before = time.time()
    status = read_status(object_store.uri)
    after = time.time()
    assert status["state"] == "running" and status["rows_total"] == 4 and status["predictor_version"] == "7"
    assert status["rows_done"] == 3 and status["rows_failed"] == 1
    # 10 tokens this run (4 were resumed) since it started, as of the read
    assert round(10 / (after - started), 2) <= status["output_tokens_per_s"] <= round(10 / (before - started), 2)
    assert json.loads(object_store.get("status.json"))["predictor"] == "champion"


def test_input_by_uri_jsonl_and_parquet(object_store: ObjectStore):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [json.dumps(_request("a")), "", "{broken", json.dumps(_request("a", max_tokens=3)), json.dumps(_request("b"))]
    object_store.put("jobs/in.jsonl", ("\n".join(lines) + "\n").encode())
    rows = list(read_input(object_store.child("jobs", "in.jsonl").uri, MODEL))
    assert [r.line for r in rows] == [1, 3, 4, 5]
    assert rows[0].request.model == MODEL and rows[3].error is None
    assert rows[1].error == "line 3: invalid JSON" and "already used on line 1" in rows[2].error

    items = [_request("p0"), _request("p1", max_tokens=3)]
    table = pa.table({"custom_id": [i["custom_id"] for i in items], "body": [json.dumps(i["body"]) for i in items]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    object_store.put("jobs/in.parquet", sink.getvalue().to_pybytes())
    rows = list(read_input(object_store.child("jobs", "in.parquet").uri, MODEL))
    assert [(r.custom_id, r.error) for r in rows] == [("p0", None), ("p1", None)]
    assert rows[1].request.requested_max_tokens() == 3

    with pytest.raises(FileNotFoundError, match="does not exist"):
        next(read_input(object_store.child("jobs", "missing.jsonl").uri, MODEL))


def test_results_parquet_goes_to_the_store(object_store: ObjectStore):
    import io

    import pyarrow.parquet as pq

    store = ResultStore(object_store)
    store.writer().append_many([_ok(2, 5), error_row(InputRow(1, None, error="line 1: invalid JSON"))])
    store.finalize({1, 2})
    assert store.write_parquet() == object_store.child("results.parquet").uri
    table = pq.read_table(io.BytesIO(object_store.get("results.parquet"))).to_pylist()
    assert [r["line"] for r in table] == [1, 2] and json.loads(table[1]["response"])["body"]["usage"]["completion_tokens"] == 5


def test_the_predictor_is_pinned_once_for_the_job(home, monkeypatch: pytest.MonkeyPatch):
    import predictor.loading as loading
    from foreserve.batch.job import pin_predictor

    looked_up = []

    def resolve(name, store=None):
        looked_up.append(name)
        if name == "champion":
            return "/cache/5", "5"
        return (f"/cache/{name}", name) if name.isdigit() else ("max", "0")

    monkeypatch.setattr(loading, "resolve_predictor", resolve)
    assert pin_predictor("champion") == ("5", "5")  # the number, which every node can look up
    assert looked_up == ["champion", "5"]  # the number's lookup too: a stage on this machine finds it cached
    assert pin_predictor("max") == ("max", "0")
    recorded = {"predictor": "champion", "predictor_source": "4", "predictor_version": "4"}
    looked_up.clear()
    assert pin_predictor("champion", recorded) == ("4", "4") and looked_up == []  # a resumed job keeps its version
    assert pin_predictor("max", recorded) == ("max", "0")  # another predictor asked for: resolved anew

    monkeypatch.setattr(loading, "resolve_predictor", lambda name, store=None: ("max", "max-fallback"))
    assert pin_predictor("champion") == ("max", "max-fallback")


def test_an_actor_no_node_takes_fails_the_job_naming_it(monkeypatch: pytest.MonkeyPatch):
    import foreserve.batch.workers as batch_workers

    states = {"engine actor 1 of 2": "ALIVE", "engine actor 2 of 2": "PENDING_CREATION"}
    workers = [batch_workers.Worker(name, name, {"CPU": 1.0, "node_b": 0.01}) for name in states]
    monkeypatch.setattr(batch_workers, "actor_state", lambda actor: states[actor])
    clock = [100.0]
    monkeypatch.setattr(batch_workers.time, "monotonic", lambda: clock[0])
    deadline = batch_workers.StartDeadline(workers, timeout_s=60, started=100.0)
    clock[0] = 150.0
    deadline.check(workers)  # still within the deadline
    clock[0] = 161.0
    with pytest.raises(RuntimeError, match=r"engine actor 2 of 2 was started 61 s ago and is not up \(Ray state "
                                           r"PENDING_CREATION\): it needs \{'CPU': 1.0, 'node_b': 0.01\}"):
        deadline.check(workers)

    states["engine actor 2 of 2"] = "ALIVE"
    deadline.check(workers)
    states["engine actor 1 of 2"] = "RESTARTING"  # its node died: the deadline starts again at the restart
    clock[0] = 200.0
    deadline.check(workers)
    clock[0] = 255.0
    deadline.check(workers)
    clock[0] = 261.0
    with pytest.raises(RuntimeError, match="engine actor 1 of 2 was restarted after it died 61 s ago"):
        deadline.check(workers)
