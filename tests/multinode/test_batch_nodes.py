"""A batch job whose engine actor runs on another node than its driver, with its input, parts, status
and results on an S3 store (a real S3-compatible server) and nothing on the driver's disk: it
answers every input line once; and when that node dies mid-job (its raylet killed, its data dir
gone) and a new node with the same resource joins, the job still succeeds, regenerating only rows
that no chunk held."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest

from app import paths
from predictor.object_store import ObjectStore

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.model, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROWS = 12
OVERRIDES = {"kv_cache_tokens": 2048, "torch_threads": 1}
ON_NODE_B = {"node_b": 0.01}


def _job_store(s3_uri: str) -> tuple[ObjectStore, str, str]:
    """A fresh prefix on the S3 server with ``ROWS`` input lines; (its store, the input's URI, the output's URI)."""
    store = ObjectStore(s3_uri).child(f"batch-{uuid.uuid4().hex[:8]}")
    lines = [json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}, one number per line."}],
        "max_tokens": 8, "temperature": 0, "ignore_eos": True}}) for i in range(ROWS)]
    store.put("in.jsonl", ("\n".join(lines) + "\n").encode())
    return store, store.child("in.jsonl").uri, store.child("out").uri


def _run(src: str, out: str, **kwargs) -> dict:
    from foreserve.batch.job import run_job

    return run_job(src, out, batch_size=2, engine_overrides=OVERRIDES, predictor="max", engine_cpus=1.0,
                   backend="actors", progress=False, node_resources=ON_NODE_B, **kwargs)


def _once(results: list[dict]) -> None:
    assert [x["line"] for x in results] == list(range(1, ROWS + 1))  # every input line once, in order
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in results)
    assert all(x["output_tokens"] == 8 for x in results)


def test_a_job_with_its_engine_on_another_node_keeps_its_state_in_the_store(s3_uri, s3_cluster):
    from app.batch.io import ResultStore
    from predictor.feedback import read_feedback

    cluster = s3_cluster  # every node has the S3 server's credentials in its environment

    _, src, out = _job_store(s3_uri)
    summary = _run(src, out)
    assert summary["rows"] == ROWS and summary["ran"] == ROWS and summary["errors"] == 0
    assert summary["results"] == ObjectStore(out).child("results.jsonl").uri
    store = ResultStore(out)
    _once(store.results())
    status = store.status()
    assert status["state"] == "succeeded" and status["output"] == ObjectStore(out).uri
    assert status["predictor_version"] == summary["predictor_version"]
    assert len(read_feedback(cluster.homes["node_b"] / "feedback")) == ROWS  # generated on node_b


def _node_with(cluster, resource: str):
    return next(n for n in cluster.cluster.worker_nodes if resource in (n._ray_params.resources or {}))


def _settled(store, quiet_s: float = 5.0, limit_s: float = 60.0) -> dict:
    """The rows in the store once it has stopped changing for ``quiet_s``: a killed node's worker
    processes outlive its raylet for a moment, and one of them may still be putting a chunk."""
    rows, since, deadline = store.answered(), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the store kept changing after the node was killed"
        time.sleep(0.5)
        now = store.answered()
        if now.keys() != rows.keys():
            rows, since = now, time.monotonic()
    return rows


def test_a_job_survives_the_death_of_its_engine_node(s3_uri, s3_cluster, tmp_path: Path):
    from app.batch.io import ResultStore
    from predictor.feedback import read_feedback
    from tests.services import S3_ENV

    cluster = s3_cluster

    _, src, out = _job_store(s3_uri)
    store = ResultStore(out)
    outcome: dict = {}

    def job() -> None:
        try:
            outcome["summary"] = _run(src, out, start_timeout_s=300)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc

    runner = threading.Thread(target=job, daemon=True)
    started = time.monotonic()
    runner.start()
    deadline = time.monotonic() + 300
    while not store.done_lines():  # the first chunk of rows is in the store
        assert runner.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.1)
    cluster.cluster.remove_node(_node_with(cluster, "node_b"), allow_graceful=False)
    stored = _settled(store)  # everything the dead node stored
    assert 0 < len(stored) < ROWS, "the job ended before its node could be killed"
    shutil.rmtree(cluster.homes["node_b"])

    home = tmp_path / "node_b2"  # a new machine: its own data dir, the prepared model only
    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())
    env = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true", "FORESERVE_HOME": str(home), **S3_ENV}
    cluster.cluster.add_node(num_cpus=1, resources={"node_b": 1}, env_vars=env)
    cluster.homes["node_b"] = home

    runner.join(timeout=480)
    assert not runner.is_alive() and "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["rows"] == ROWS
    results = store.results()
    _once(results)
    for line, row in stored.items():  # what was stored before the node died was not redone
        assert results[line - 1]["response"]["request_id"] == row.response["request_id"]
    parts = store.rows()
    assert sorted(r.line for r in parts) == list(range(1, ROWS + 1))  # no line stored twice
    # the new node generated exactly the lines no chunk held: those the dead node never reached and
    # those it had finished but not stored, fewer than FLUSH_ROWS (here its one batch in flight: a
    # batch of 2 rows is stored whole when it ends); nothing it generated was thrown away
    generated = {r.request_id for r in read_feedback(home / "feedback")}
    answered_by = {x["response"]["request_id"] for x in results}
    assert generated <= answered_by
    assert len(generated) == ROWS - len(stored)
    print(json.dumps({"rows_in": ROWS, "rows_out": len(results), "lines_stored_twice": len(parts) - ROWS,
                      "stored_before_the_node_died": len(stored), "generated_by_the_new_node": ROWS - len(stored),
                      "wall_s": round(time.monotonic() - started, 1)}))
