"""Run by ``test_gcs_restart.py`` in a pytest process of its own (see there why).

The head's GCS dies under load and comes back, with Ray's GCS fault tolerance on a real Redis
(Debian's ``redis-server``): the cluster's tables live in Redis, so a restarted GCS picks them up.

While it is down, streams open at the kill are answered in full and new chats are answered by the
same replicas (the data path, proxy to ingress to engine, never asks the GCS); a deploy, which
does (``foreserve serve`` joining the cluster), fails within seconds and says why. Once the GCS is
back, the same replicas serve on, and the control plane works again (a new app deploys).

This test's driver leaves the cluster for the outage and joins it again after: a connected driver
polls the lost GCS without pause (Ray's error listener thread), most of a core of the two that the
four nodes share here. Its chats and streams are plain HTTP to the proxy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
import yaml

from app.config import DEFAULT_CONFIG_PATH
from app.ports import free_port
from tests.multinode.serving import MODEL, chat, deploy, wait_for

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
PLACES = {"ingress": ("node_a", 0.1), "predictor": ("node_a", 0.25), "online": ("node_b", 0.5), "offline": ("node_c", 0.5)}
OUTAGE_S = 45  # below tests.conftest.GCS_RECONNECT_S, after which raylets and drivers give the GCS up and end


def _config(tmp_path: Path) -> Path:
    """serve_config.yaml with one replica per deployment pinned to a node (``PLACES``), sized for
    1-CPU nodes, the predictor reserving ``max_tokens`` (the registry is not what is tested)."""
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    app = data["applications"][0]
    app["args"]["store"] = str(tmp_path / "store")
    app["args"]["predictor"].update(source="max", retrain_enabled=False)
    for pool in ("online", "offline"):  # no load shedding: Ray's processes retrying the lost GCS share
        # the two cores with the engines, and a chat may wait past the online pool's queue delay
        app["args"]["pools"][pool].update(kv_cache_tokens=2048, torch_threads=1, max_queue_delay_ms=None)
    app.pop("autoscaling_policy", None)
    for deployment in app["deployments"]:
        node, cpus = PLACES[deployment["name"]]
        deployment["ray_actor_options"] = {"num_cpus": cpus, "resources": {node: 0.01}}
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = 1
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _replicas() -> dict[str, list[str]]:
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    return {name: sorted(r["replica_id"] for r in d["replicas"] if r["state"] == "RUNNING")
            for app in details["applications"].values() for name, d in app["deployments"].items()}


def _stream(url: str, out: list[dict]) -> None:
    """A streamed chat of 48 tokens; appends what came back: the tokens its usage counts, the error
    chunks, whether ``data: [DONE]`` ended it."""
    body = {"model": MODEL, "max_tokens": 48, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "Tell me a story."}]}
    got = {"tokens": 0, "errors": [], "done": False}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[len("data: "):])
                    got["tokens"] = (chunk.get("usage") or {}).get("completion_tokens", got["tokens"])
                    got["errors"] += [chunk["error"]] if "error" in chunk else []
    except httpx.HTTPError as exc:
        got["errors"].append(type(exc).__name__)
    out.append(got)


def _join(config: Path, address: str, since: float, out: dict) -> None:
    """``foreserve serve`` joining the cluster at ``address``; ``out``: its exit code (None: killed
    after 40 s), its stderr, and the seconds from ``since`` to its end."""
    proc = subprocess.Popen([sys.executable, "-m", "foreserve.cli.main", "serve", "--no-prepare", "--config", str(config),
                             "--port", str(free_port())], env={**os.environ, "RAY_ADDRESS": address},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stderr = proc.communicate(timeout=40)[1]
        out.update(code=proc.returncode, s=time.monotonic() - since)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stderr = proc.communicate()[1]
        out.update(code=None, s=time.monotonic() - since)
    out["stderr"] = stderr[-2000:]


def test_the_service_serves_through_a_gcs_restart_and_a_deploy_meanwhile_fails_loudly(gcs_ft_cluster, tmp_path: Path):
    from ray import serve

    config = _config(tmp_path)
    url, _ = deploy(config, {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    wait_for(lambda: httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok", 300, "the service up")
    assert chat(url).status_code == 200
    before = _replicas()

    streams: list[dict] = []
    threads = [threading.Thread(target=_stream, args=(url, streams)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the streams are open
    ray.shutdown()  # NOTE: back after the outage (see the module's docstring)
    head = gcs_ft_cluster.cluster.head_node
    head.kill_gcs_server()
    killed = time.monotonic()
    try:  # every wait below is bounded: the nodes give a GCS up after GCS_RECONNECT_S (conftest)
        joining: dict = {}  # a deploy meanwhile: `foreserve serve` joining the cluster, in a thread of its own
        deployer = threading.Thread(target=_join, args=(config, gcs_ft_cluster.address, killed, joining))
        deployer.start()
        during, took = [], []
        for _ in range(3):
            t0 = time.monotonic()
            during.append(chat(url, timeout_s=60).status_code)
            took.append(time.monotonic() - t0)
        health = httpx.get(f"{url}/health", timeout=60)
        for t in threads:
            t.join(60)
        deployer.join(60)
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed)))
    finally:
        head.start_gcs_server()
    restarted = time.monotonic()
    ray.init(address=gcs_ft_cluster.address, log_to_driver=False)

    assert during == [200, 200, 200]
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert streams == [{"tokens": 48, "errors": [], "done": True}] * 3  # answered in full
    assert joining["code"] not in (0, None), joining  # it ended, and in failure
    assert "GCS" in joining["stderr"] and "Traceback" not in joining["stderr"], joining

    wait_for(lambda: chat(url).status_code == 200, 60, "a chat answered after the GCS came back")
    print(f"GCS down {restarted - killed:.0f} s: chats answered in {', '.join(f'{t:.1f}' for t in took)} s; the deploy "
          f"failed after {joining['s']:.1f} s; a chat answered {time.monotonic() - restarted:.1f} s after the restart")
    assert _replicas() == before  # the same replicas: nothing was restarted

    @serve.deployment(ray_actor_options={"num_cpus": 0, "resources": {"node_a": 0.01}})
    def probe() -> str:
        return "up"

    assert serve.run(probe.bind(), name="after-the-outage", route_prefix=None).remote().result(timeout_s=60) == "up"
    serve.delete("after-the-outage")
