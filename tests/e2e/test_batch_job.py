"""Small real batch jobs on Ray Data with the real model: per-row errors, results in input order,
one output line per input line, feedback records and the pinned predictor version; exactly once when
a job is resumed, when an engine actor is killed mid-batch, and when a Ray Job is stopped and
resubmitted with the same id; a job whose engine actors no node can take fails, naming them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from app import paths
from app.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SUMS = [f"What is {a} plus {b}? Reply with the number only." for a, b in [(2, 3), (7, 8), (4, 4), (6, 9), (3, 3)]]


def _input(path: Path) -> None:
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0}})
             for i, q in enumerate(SUMS)]
    lines.insert(2, "{broken json")
    lines.append(json.dumps({"custom_id": "q0", "body": {"messages": [{"role": "user", "content": "again"}]}}))
    path.write_text("\n".join(lines) + "\n")


OVERRIDES = {"kv_cache_tokens": 2048, "torch_threads": 1}


def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A private data dir holding only the prepared model (read-only link): feedback lands there."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())
    env = {"FORESERVE_HOME": str(home), "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_AUTH_MODE": "disabled"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _sums(path: Path, n: int, max_tokens: int) -> None:
    path.write_text("".join(json.dumps({"custom_id": f"s{i}", "body": {
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}, one number per line."}],
        "max_tokens": max_tokens, "temperature": 0}}) + "\n" for i in range(n)))


def _once(results: Path, n: int) -> list[dict]:
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert [x["line"] for x in lines] == list(range(1, n + 1))  # every input line once, in order
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in lines)
    return lines


def test_batch_job_answers_every_line_once_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import ray

    from foreserve.batch.job import run_job
    from app.batch.io import ResultStore
    from predictor.feedback import read_feedback

    env = _home(tmp_path, monkeypatch)
    home = Path(env["FORESERVE_HOME"])
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    _input(src)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        overrides = OVERRIDES
        summary = run_job(src, out, replicas=1, batch_size=3, engine_overrides=overrides, predictor="max", engine_cpus=0.5, progress=False)
        assert summary["rows"] == 7 and summary["errors"] == 2 and summary["ran"] == 5 and summary["output_tokens"] > 0
        lines = [json.loads(x) for x in Path(summary["results"]).read_text().splitlines()]
        assert [x["line"] for x in lines] == list(range(1, 8))  # input order, one line each
        assert [x["custom_id"] for x in lines] == ["q0", "q1", None, "q2", "q3", "q4", "q0"]
        ok = [x for x in lines if x["error"] is None]
        assert len(ok) == 5 and all(x["response"]["status_code"] == 200 for x in ok)
        for x in ok:
            body = x["response"]["body"]
            assert body["choices"][0]["message"]["content"].strip() and body["usage"]["completion_tokens"] == x["output_tokens"] <= 12
            assert x["predicted_tokens"] == 12  # predictor max: the row's whole max_tokens, not a sentinel
        assert lines[2]["error"]["message"] == "line 3: invalid JSON"
        assert "already used on line 1" in lines[6]["error"]["message"]
        feedback = read_feedback(home / "feedback")
        assert len(feedback) == 5 and {f.tier for f in feedback} == {"offline"}
        status = ResultStore(out).status()
        assert status["state"] == "succeeded" and status["predictor"] == "max"
        assert {f.predictor_version for f in feedback} == {status["predictor_version"]} == {summary["predictor_version"]}

        again = run_job(src, out, replicas=1, batch_size=3, engine_overrides=overrides, predictor="max", engine_cpus=0.5, progress=False)
        assert again["rows_resumed"] == 7 and again["ran"] == 0
        assert Path(again["results"]).read_text().splitlines() == Path(summary["results"]).read_text().splitlines()

        # a job stopped after some rows: drop two answered rows from the parts, resubmit, get them back once
        store = ResultStore(out)
        kept = [r for r in store.rows() if r.line not in (4, 6)]
        for key in store.parts.keys():
            store.parts.delete(key)
        store.writer().append_many(kept)
        resumed = run_job(src, out, replicas=1, batch_size=3, engine_overrides=overrides, predictor="max", engine_cpus=0.5, progress=False)
        assert resumed["rows_resumed"] == 5 and resumed["ran"] == 2
        final = [json.loads(x) for x in Path(resumed["results"]).read_text().splitlines()]
        assert [x["line"] for x in final] == list(range(1, 8)) and final[3]["custom_id"] == "q2" and final[5]["error"] is None
    finally:
        ray.shutdown()


def test_engine_actor_killed_midway_loses_and_duplicates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import ray

    from foreserve.batch.job import run_job
    from app.batch.io import ResultStore
    from loadtests.bench.batch_job import engine_actor_pid

    env = _home(tmp_path, monkeypatch)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    _sums(src, 6, 24)
    killed: list[int] = []

    def kill_after_first_rows() -> None:  # SIGKILL the engine actor once it has written a row
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            if ResultStore(out).done_lines() and (pid := engine_actor_pid()):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.2)

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        killer = threading.Thread(target=kill_after_first_rows, daemon=True)
        killer.start()
        summary = run_job(src, out, batch_size=2, engine_overrides=OVERRIDES, predictor="max", engine_cpus=0.5,
                          backend="actors", progress=False)
        killer.join(5)
        assert killed, "the engine actor was never killed"
        assert summary["rows"] == 6
        _once(Path(summary["results"]), 6)
        written = [r.line for r in ResultStore(out).rows()]
        assert sorted(written) == list(range(1, 7))  # the retried batch skipped the rows already stored
    finally:
        ray.shutdown()


def test_ray_job_stopped_and_resubmitted_with_same_id_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import ray
    from ray.job_submission import JobSubmissionClient

    from app.batch import jobs
    from app.batch.io import ResultStore

    env = _home(tmp_path, monkeypatch)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    _sums(src, 6, 24)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             runtime_env={"env_vars": env})
    try:
        client = JobSubmissionClient(f"http://127.0.0.1:{port}")
        extra = ["--batch-size", "2", "--predictor", "max", "--engine-cpus", "0.5", "--engine", json.dumps(OVERRIDES)]
        job = jobs.submit(src, out, "job-a", backend="actors", extra_args=extra, jobs=client)
        assert job == "job-a"
        deadline = time.monotonic() + 240
        while not ResultStore(out).done_lines():
            assert time.monotonic() < deadline and jobs.status(job, client)["ray_status"] not in jobs.TERMINAL
            time.sleep(0.5)
        assert jobs.stop(job, client)
        stopped = jobs.wait(job, client, poll_s=0.5)
        assert stopped["ray_status"] == "STOPPED" and 0 < stopped["rows_done"] < 6
        with pytest.raises(jobs.JobError, match="wrote to"):
            jobs.submit(src, tmp_path / "elsewhere", "job-a", jobs=client)
        jobs.submit(src, out, "job-a", backend="actors", extra_args=extra, jobs=client)
        done = jobs.wait(job, client, poll_s=1)
        assert done["ray_status"] == "SUCCEEDED", done
        assert done["summary"]["rows_resumed"] >= stopped["rows_done"]  # rows may land while it stops
        assert done["summary"]["ran"] == 6 - done["summary"]["rows_resumed"]
        _once(jobs.results_path(job, client), 6)
    finally:
        ray.shutdown()


def test_engine_actors_no_node_can_take_fail_the_job_naming_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import ray

    from foreserve.batch.job import run_job

    env = _home(tmp_path, monkeypatch)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    _sums(src, 2, 4)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"engine actor 1 of 1 was started \d+ s ago and is not up \(Ray state "
                                               r"PENDING_CREATION\): it needs .*'nowhere': 1\.0"):
            run_job(src, out, engine_overrides=OVERRIDES, predictor="max", engine_cpus=0.5, backend="actors",
                    progress=False, node_resources={"nowhere": 1.0}, start_timeout_s=5)
        assert time.monotonic() - t0 < 120  # a hang guard: without start_timeout_s the job waits for the actor forever
    finally:
        ray.shutdown()
