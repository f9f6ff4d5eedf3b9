"""Batch job input/output: per-line errors, duplicate custom_ids, the default model, an unreadable
file, and exactly-once results across workers, a record cut short and a resumed job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.batch.io import InputRow, ResultStore, error_row, ok_row, read_input

MODEL = "SmolLM2-135M-Instruct"


def _line(custom_id: str | None, **body) -> str:
    item = {"method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], **body}}
    if custom_id is not None:
        item["custom_id"] = custom_id
    return json.dumps(item)


def _completion(n: int) -> dict:
    return {"id": f"chatcmpl-{n}", "object": "chat.completion", "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}


def test_bad_lines_become_error_rows_and_the_first_duplicate_is_answered(tmp_path: Path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        _line("a"),
        "{not json",
        _line(None),
        _line("a", max_tokens=5),
        _line("b", temperature=9),
        "",
        _line("c", model="other-model"),
        json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/models"}),
        _line("e", max_tokens=7),
    ]) + "\n")
    rows = list(read_input(path, MODEL))
    assert [r.line for r in rows] == [1, 2, 3, 4, 5, 7, 8, 9]  # the blank line is not a row
    ok = {r.line: r for r in rows if r.error is None}
    assert sorted(ok) == [1, 7, 9]
    assert ok[1].request.model == MODEL and ok[7].request.model == "other-model"  # the served model by default
    assert ok[9].request.requested_max_tokens() == 7
    errors = {r.line: (r.custom_id, r.error) for r in rows if r.error is not None}
    assert errors[2] == (None, "line 2: invalid JSON")
    assert errors[3] == (None, "line 3: missing custom_id")
    assert errors[4][0] == "a" and "already used on line 1" in errors[4][1]
    assert errors[5][0] == "b" and "temperature" in errors[5][1]
    assert "only POST" in errors[8][1]


def test_completions_lines_are_read_beside_chat_lines(tmp_path: Path):
    """A line for /v1/completions (a prompt as text or ids) is a completion request; anything else is an error row."""
    from app.api.completions import CompletionRequest
    from foreserve.batch.job import url_of
    from foreserve.batch.stages import completion_body

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        json.dumps({"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 9}}),
        json.dumps({"custom_id": "i", "url": "/v1/completions", "body": {"prompt": [5, 6, 7]}}),
        json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "hi", "echo": True}}),
        _line("c"),
    ]) + "\n")
    rows = list(read_input(path, MODEL))
    assert [type(r.request).__name__ for r in rows] == ["CompletionRequest", "CompletionRequest", "NoneType",
                                                        "ChatCompletionRequest"]
    assert rows[0].request.requested_max_tokens() == 9 and rows[1].request.requested_max_tokens() == 16  # OpenAI's default
    assert "echo is not supported" in rows[2].error
    assert [url_of(r.request) for r in (rows[0], rows[3])] == ["/v1/completions", "/v1/chat/completions"]

    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

        def __len__(self):
            return 7

    assert rows[0].request.predictor_text(None) == "Once upon a time"
    assert rows[1].request.predictor_text(Tok()) == "5 6"  # an id past the tokenizer is left out
    assert isinstance(rows[1].request, CompletionRequest)
    body = completion_body("cmpl-1", MODEL, " there was", 4, 3, "length", chat=False)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " there was"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == 7


def test_an_unreadable_input_fails_fast(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_input(tmp_path / "missing.jsonl", MODEL))


def test_results_exactly_once_across_workers_crashes_and_resume(tmp_path: Path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(_line(f"r{i}") for i in range(6)) + "\n{bad\n")
    rows = list(read_input(path, MODEL))
    store = ResultStore(tmp_path / "out")
    first, second = store.writer(), store.writer()
    first.append(ok_row(rows[0], _completion(4), predicted_tokens=102))
    second.append(ok_row(rows[1], _completion(9), predicted_tokens=102))
    second.append(ok_row(rows[0], _completion(5), predicted_tokens=102))  # a retried worker answers row 1 again
    store.parts.put("old-layout.jsonl", b'{"id": "batch_req_3", "custom_id": "r2", "li')  # a record cut short is skipped
    assert store.done_lines() == {1, 2}
    with pytest.raises(RuntimeError, match="5 input lines have no result"):
        store.finalize({r.line for r in rows})

    resumed = store.writer()  # the job resubmitted with the same output dir skips lines 1 and 2
    for row in rows:
        if row.line in store.done_lines():
            continue
        resumed.append(error_row(row) if row.error else ok_row(row, _completion(row.line), predicted_tokens=204))
    out = store.finalize({r.line for r in rows})
    assert out == str(tmp_path / "out" / "results.jsonl")
    lines = [json.loads(x) for x in Path(out).read_text().splitlines()]
    assert len(lines) == len(rows) == 7 and [x["line"] for x in lines] == [1, 2, 3, 4, 5, 6, 7]
    assert lines[0]["response"]["body"]["usage"]["completion_tokens"] in (4, 5)  # one of the two answers, once
    assert lines[1]["custom_id"] == "r1" and lines[1]["output_tokens"] == 9 and lines[1]["predicted_tokens"] == 102
    assert lines[6]["custom_id"] is None and lines[6]["response"] is None
    assert lines[6]["error"] == {"code": "invalid_request", "message": "line 7: invalid JSON"}


def test_parquet_input_with_json_string_bodies(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    items = [json.loads(_line("p0")), json.loads(_line("p1", max_tokens=3))]
    table = pa.table({"custom_id": [i["custom_id"] for i in items], "method": ["POST"] * 2,
                      "url": ["/v1/chat/completions"] * 2, "body": [json.dumps(i["body"]) for i in items]})
    pq.write_table(table, tmp_path / "in.parquet")
    rows = list(read_input(tmp_path / "in.parquet", MODEL))
    assert [(r.custom_id, r.error) for r in rows] == [("p0", None), ("p1", None)]
    assert rows[1].request.requested_max_tokens() == 3


def test_submit_fails_fast_on_unreadable_input_before_any_cluster(tmp_path, capsys, monkeypatch):
    from foreserve import cli
    from app.batch import jobs

    monkeypatch.setattr(jobs, "client", lambda *a, **k: pytest.fail("no cluster may be started for a bad input"))
    assert cli.main(["batch", "submit", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_status_counts_rows_from_parts_while_running(tmp_path):
    from app.batch.io import read_status, write_status
    from app.batch.io import InputRow, ResultStore, error_row

    write_status(tmp_path, state="running", rows_total=3, started_at=1.0)
    ResultStore(tmp_path).writer().append_many([error_row(InputRow(1, "a", error="x")), error_row(InputRow(1, "a", error="x")),
                                               error_row(InputRow(3, None, error="y"))])
    status = read_status(tmp_path)
    assert status["state"] == "running" and status["rows_total"] == 3 and status["rows_done"] == 2


def test_results_parquet_has_every_line_and_json_bodies(tmp_path: Path):
    import pyarrow.parquet as pq

    from foreserve.batch.stages import completion_body
    from app.batch.io import InputRow

    store = ResultStore(tmp_path)
    body = completion_body("r1", MODEL, "hi", 5, 2, "stop")
    store.writer().append_many([ok_row(InputRow(2, "b"), body, 8), error_row(InputRow(1, None, error="line 1: invalid JSON"))])
    store.finalize({1, 2})
    table = pq.read_table(store.write_parquet()).to_pylist()
    assert [r["line"] for r in table] == [1, 2] and table[0]["response"] is None
    assert json.loads(table[0]["error"])["message"] == "line 1: invalid JSON"
    assert json.loads(table[1]["response"])["body"]["usage"]["completion_tokens"] == 2 == table[1]["output_tokens"]


def test_batch_api_without_a_ray_job_loses_nothing(tmp_path: Path, monkeypatch):
    """A submit that fails leaves no batch behind (503); a batch whose Ray job is gone (cluster
    restarted) reports what its job left in the store instead of failing the request."""
    from app.batch import jobs
    from app.api.errors import APIError
    from app.batch.io import write_status
    from app.batch.api import BatchCreate, BatchStore

    def gone(*_a, **_k):
        raise jobs.JobError("no batch job")

    monkeypatch.setattr(jobs, "client", lambda *a, **k: object())
    store = BatchStore(tmp_path)
    file = store.add_file("in.jsonl", b'{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}\n', "batch")
    request = BatchCreate(input_file_id=file.id, endpoint="/v1/chat/completions")
    monkeypatch.setattr(jobs, "submit", gone)
    with pytest.raises(APIError) as exc:
        store.create(request)
    assert exc.value.status_code == 503 and not [k for k in store.store.keys() if k.startswith("batch_")]

    monkeypatch.setattr(jobs, "submit", lambda *a, **k: "ok")
    done, lost = store.create(request), store.create(request)
    monkeypatch.setattr(jobs, "status", gone)
    out = store.output_uri(done.id)  # what the job was handed
    write_status(out, state="succeeded", rows_total=1, started_at=1.0, finished_at=2.0)
    ResultStore(out).writer().append_many([error_row(InputRow(1, "a", error="x"))])
    ResultStore(out).finalize({1})
    got = store.get(done.id)
    assert got.status == "completed" and got.output_file_id and got.request_counts.total == 1
    failed = store.get(lost.id)
    assert failed.status == "failed" and "cluster restarted" in failed.errors["data"][0]["message"]
