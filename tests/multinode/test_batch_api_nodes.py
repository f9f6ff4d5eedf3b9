"""OpenAI's Files and Batch API on a cluster: the foreserve app with two ingress replicas on two
worker nodes (each node with a data dir of its own) and its store on an S3-compatible server (a
real one, moto) that every node opens. Either replica answers for any file or batch the other took,
the replicas submit the jobs to the head's Jobs API (its dashboard, found from the cluster itself),
and a batch's job, on another node than the upload's replica, reads the upload by its URI.

Serve's proxy spreads requests over both replicas at random, so 100 requests all on one replica
would take a chance of 2^-99; a replica that kept state on its own node would answer 404."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from app.ports import free_port
from predictor.object_store import ObjectStore

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.model, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

APP = "foreserve"
CHAT = "/v1/chat/completions"


def _rows(tag: str, n: int) -> bytes:
    lines = [json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT, "body": {
        "messages": [{"role": "user", "content": f"What is {i} plus {i}? Reply with the number only."}],
        "max_tokens": 4, "temperature": 0}}) for i in range(n)]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def served(s3_cluster, s3_uri: str):
    """serve_config.yaml's app on ``s3_cluster``, deployed as ``foreserve serve`` deploys it, with a
    fresh prefix of the S3 bucket as its store, the ingress at two replicas (at most one a node), every
    other deployment at one, the predictor at max reservation (no registry); (URL, store)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from app.config import DEFAULT_CONFIG_PATH
    from deployments.launch import application_schema, replica_env, wait_ready

    store = ObjectStore(s3_uri).child(f"batch-api-{uuid.uuid4().hex[:8]}")
    entry = application_schema(DEFAULT_CONFIG_PATH, replica_env(joined=True))  # each node keeps its own data dir
    args = entry["args"]
    args["store"] = store.uri
    args["predictor"].update(source="max", retrain_enabled=False)
    for pool in ("online", "offline"):
        args["pools"][pool].update(kv_cache_tokens=2048, torch_threads=1)
    entry.pop("autoscaling_policy", None)
    for deployment in entry["deployments"]:
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = 1
        if deployment["name"] == "ingress":
            deployment.update(num_replicas=2, max_replicas_per_node=1)
    http = {"host": "127.0.0.1", "port": free_port()}  # NOTE: this cluster's nodes share one IP: one proxy, the head's
    serve.start(proxy_location="HeadOnly", http_options=http)
    schema = ServeDeploySchema.model_validate({"proxy_location": "HeadOnly", "http_options": http, "applications": [entry]})
    _get_global_client().deploy_apps(schema, _blocking=False)
    url = f"http://127.0.0.1:{http['port']}"
    try:
        wait_ready(url, 300, APP)
        yield url, store
    finally:
        serve.delete(APP)


def _ingress_nodes() -> list[str]:
    import ray
    from ray.util.state import list_actors

    actors = list_actors(ray.get_runtime_context().gcs_address, filters=[("class_name", "=", f"ServeReplica:{APP}:ingress"), ("state", "=", "ALIVE")])
    return [actor.node_id for actor in actors]


def _upload(http: httpx.Client, name: str, content: bytes) -> str:
    response = http.post("/v1/files", files={"file": (name, content)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _create(http: httpx.Client, file_id: str) -> dict:
    response = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
    assert response.status_code == 200, response.text
    return response.json()


def test_either_ingress_replica_answers_for_every_file_and_batch(served):
    url, store = served
    nodes = _ingress_nodes()
    assert len(nodes) == 2 and len(set(nodes)) == 2, nodes  # two replicas, on two nodes
    created = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(20):
            content = _rows(f"n{i}", 1)
            file_id = _upload(http, f"rows-{i}.jsonl", content)
            batch = _create(http, file_id)
            got = http.get(f"/v1/batches/{batch['id']}")
            assert got.status_code == 200, f"round {i}: {got.text}"
            assert got.json()["input_file_id"] == file_id
            assert http.get(f"/v1/files/{file_id}").json()["bytes"] == len(content)
            assert http.get(f"/v1/files/{file_id}/content").content == content
            # NOTE: stopped at once, so that 20 jobs do not crowd the cluster's three CPUs
            cancelled = http.post(f"/v1/batches/{batch['id']}/cancel")
            assert cancelled.status_code == 200, f"round {i}: {cancelled.text}"
            assert cancelled.json()["status"] in ("cancelling", "cancelled")
            created.append(batch["id"])
        listed = http.get("/v1/batches", params={"limit": 100})
        missing = http.get("/v1/batches/batch_nope")
    assert listed.status_code == 200 and [b["id"] for b in listed.json()["data"]] == created[::-1]  # newest first
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert {f"batches/{batch_id}.json" for batch_id in created} <= set(store.keys("batches"))


def test_a_batch_job_reads_its_upload_from_the_store_and_either_replica_serves_its_output(served):
    url, store = served
    content = _rows("sum", 2)
    with httpx.Client(base_url=url, timeout=120) as http:
        batch = _create(http, _upload(http, "sums.jsonl", content))
        deadline = time.monotonic() + 300
        while batch["status"] not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(2)
            response = http.get(f"/v1/batches/{batch['id']}")
            assert response.status_code == 200, response.text
            batch = response.json()
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
        outputs = {http.get(f"/v1/files/{batch['output_file_id']}/content").content for _ in range(6)}
    assert len(outputs) == 1  # the same bytes from whichever replica answered
    rows = [json.loads(line) for line in outputs.pop().splitlines()]
    assert [row["custom_id"] for row in rows] == ["sum-0", "sum-1"]
    assert all(row["error"] is None and row["response"]["status_code"] == 200 for row in rows)
    assert store.exists(f"batches/{batch['id']}/results.jsonl")
