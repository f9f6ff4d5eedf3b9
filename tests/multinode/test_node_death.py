"""A node dies under the service: first the one that runs the predictor, then the one that runs the
ingress while a stream is open. The nodes are removed without grace (their raylet and workers
killed, as a machine that loses power), their data dirs deleted, and a new node with the same
custom resource joins. Chat keeps answering (with max reservation while the predictor is away), the
stream through the dead ingress ends instead of hanging, the engine frees what that stream held,
and ``/health`` comes back to ``ok`` with the champion serving."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app import paths
from app.config import DEFAULT_CONFIG_PATH
from app.ports import free_port
from predictor.store import Store
from predictor.tracking_server import TrackingServer
from predictor.training.pipeline import train_and_register
from tests.multinode.serving import MODEL, chat, deploy, wait_for
from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.mlflow, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
NODE_ENV = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true"}
PLACES = {"ingress": ("node_a", 0.1), "predictor": ("node_b", 0.25), "online": ("node_c", 0.5), "offline": ("node_c", 0.5)}


def _config(tmp_path: Path, store: str) -> Path:
    """serve_config.yaml, its deployments pinned to nodes (``PLACES``), sized for 1-CPU nodes."""
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    app = data["applications"][0]
    app["args"]["store"] = store
    app["args"]["predictor"].update(poll_s=2, retrain_enabled=False)
    app["args"]["pools"]["online"].update(kv_cache_tokens=2048, torch_threads=1)
    app["args"]["pools"]["offline"].update(kv_cache_tokens=2048, torch_threads=1)
    for deployment in app["deployments"]:
        node, cpus = PLACES[deployment["name"]]
        deployment["ray_actor_options"] = {"num_cpus": cpus, "resources": {node: 0.01}}
    app.pop("autoscaling_policy", None)  # placement is what is tested; the pools stay at one replica
    for name in ("online", "offline"):
        spec = next(d for d in app["deployments"] if d["name"] == name)
        spec.pop("autoscaling_config", None)
        spec["num_replicas"] = 1
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _replace_node(cluster, name: str, root: Path) -> None:
    """Kill the node holding custom resource ``name`` without grace, delete its data dir, and add a
    new node with that resource and an empty data dir but for the model (its replicas reload)."""
    import ray

    ids = {r["NodeID"] for r in ray.nodes() if r["Alive"] and r["Resources"].get(name)}
    node = next(n for n in cluster.cluster.worker_nodes if n.node_id in ids)
    cluster.cluster.remove_node(node, allow_graceful=False)
    shutil.rmtree(cluster.homes[name], ignore_errors=True)
    home = root / f"{name}-new"
    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())
    cluster.homes[name] = home
    cluster.cluster.add_node(num_cpus=1, resources={name: 1}, env_vars={**NODE_ENV, "FORESERVE_HOME": str(home)})
    cluster.cluster.wait_for_nodes()


def test_the_service_survives_the_death_of_the_predictor_node_then_the_ingress_node(cluster, tmp_path: Path):
    from ray import serve

    server = TrackingServer(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts"), port=free_port(),
                            log_path=tmp_path / "mlflow.log")
    with server:
        trained = train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=Store(tmp_path / "driver", server.url))
        assert trained["promoted"]
        url, app = deploy(_config(tmp_path, str(tmp_path / "store")), {**NODE_ENV, "MLFLOW_TRACKING_URI": server.url})
        try:
            health = wait_for(lambda: (h := httpx.get(f"{url}/health", timeout=10).json())["status"] == "ok" and h, 300,
                              "the service up")
            assert health["predictor"]["version"] == "1"

            killed = time.monotonic()
            _replace_node(cluster, "node_b", tmp_path)  # the predictor's node
            answered = chat(url)  # the predictor is gone: the ingress falls back to max reservation
            assert answered.status_code == 200 and answered.headers["x-foreserve-predictor-version"] in ("max-fallback", "1")
            wait_for(lambda: httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok", 240, "/health ok again")
            predictor_back_s = time.monotonic() - killed
            assert chat(url).headers["x-foreserve-predictor-version"] == "1"

            body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "stream": True,
                    "ignore_eos": True, "messages": [{"role": "user", "content": "Tell me a long story."}]}
            chunks, ended = 0, "completed"
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as stream:
                    for line in stream.iter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if chunks == 5:
                                killed = time.monotonic()
                                _replace_node(cluster, "node_a", tmp_path)  # the ingress's node, mid-stream
                        if line == "data: [DONE]":
                            break
            except httpx.HTTPError as exc:
                ended = type(exc).__name__
            assert chunks >= 5
            assert ended != "completed" or chunks < 400  # cut: an error, or a stream that ended early
            wait_for(lambda: chat(url).status_code == 200, 240, "a chat answered after the ingress's node died")
            ingress_back_s = time.monotonic() - killed
            stats = wait_for(lambda: (h := httpx.get(f"{url}/health", timeout=10).json())["status"] == "ok"
                             and h["pools"]["online"].get("num_running") == 0 and h, 120,
                             "/health ok with nothing left running from the cut stream")
            assert stats["predictor"]["version"] == "1"
            print(json.dumps({"predictor_node_to_health_ok_s": round(predictor_back_s, 1), "stream_chunks_before_cut": chunks,
                              "stream_ended": ended, "ingress_node_to_first_answer_s": round(ingress_back_s, 1)}))
        finally:
            serve.delete(app)
