"""`foreserve serve` joining a cluster that other people's Serve apps share (``RAY_ADDRESS``): it
refuses a registry on its own disk before touching anything, serves the whole app on the cluster's
nodes and reports the head's URL, and taking it down removes foreserve's app only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import paths
from app.ports import free_port
from predictor.tracking_server import TrackingServer

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.mlflow, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _serve(cluster, home: Path, **env: str) -> subprocess.CompletedProcess:
    """``foreserve serve --exit-when-ready`` from a client process joined to the cluster."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "FORESERVE_HOME")}
    environ.update(RAY_ADDRESS=cluster.address, RAY_AUTH_MODE="disabled", FORESERVE_HOME=str(home), **env)
    cmd = [sys.executable, "-m", "foreserve.cli.main", "serve", "--exit-when-ready", "--no-prepare",
           "--proxy-location", "HeadOnly"]  # NOTE: this cluster's nodes share one IP: one proxy per port
    return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=420)


def _apps() -> dict[str, str]:
    from ray import serve

    return {name: app.status.value for name, app in serve.status().applications.items()}


def _deploy_declaratively(cluster, port: int) -> None:
    """A small app deployed as ``serve deploy config.yaml`` does (Serve's declarative API: a later
    declarative deploy that leaves it out deletes it). Its code is one Ray ships for its own tests."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    app = {"name": "their-config", "route_prefix": "/theirs", "import_path": "ray.serve._private.test_utils:get_pid_entrypoint",
           "deployments": [{"name": "GetPID", "ray_actor_options": {"num_cpus": 0.05, **cluster.pin("node_a")}}]}
    schema = {"proxy_location": "HeadOnly", "http_options": {"host": "0.0.0.0", "port": port}, "applications": [app]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(schema), _blocking=True)


def test_serve_joins_a_shared_cluster_and_leaves_the_other_apps_alone(cluster, tmp_path: Path):
    from ray import serve

    from deployments.predictor import PredictorDeployment

    port = free_port()
    serve.start(http_options={"host": "0.0.0.0", "port": port})  # someone else's Serve, and their app
    other = PredictorDeployment.options(ray_actor_options={"num_cpus": 0.1, **cluster.pin("node_a")})
    theirs = serve.run(other.bind({"source": "max"}), name="someone-else", route_prefix=None)
    _deploy_declaratively(cluster, port)  # and an app of theirs from a config file (`serve deploy`)
    started_s = theirs.info.remote().result(timeout_s=60)["up_s"]
    client_home = tmp_path / "client"  # the machine foreserve serve runs on: the model, nothing else
    (client_home / "models").mkdir(parents=True)
    (client_home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())

    refused = _serve(cluster, client_home)  # no MLFLOW_TRACKING_URI: the client's sqlite file
    assert refused.returncode != 0
    assert "this Ray cluster has 4 nodes, but the predictor registry is sqlite:///" in refused.stderr
    assert _apps() == {"someone-else": "RUNNING", "their-config": "RUNNING"}

    server = TrackingServer(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts"), port=free_port(),
                            log_path=tmp_path / "mlflow.log")
    with server:
        served = _serve(cluster, client_home, MLFLOW_TRACKING_URI=server.url)
    assert served.returncode == 0, served.stdout[-3000:] + served.stderr[-3000:]
    assert f"foreserve is up at http://{cluster.head_ip}:{port} " in served.stdout  # Serve's port, the head's address
    assert "foreserve is degraded: predictor serves max reservation: champion: RegistryError: no champion" in served.stderr
    assert _apps() == {"someone-else": "RUNNING", "their-config": "RUNNING"}  # foreserve's app is gone; theirs run on
    assert serve.get_app_handle("someone-else").info.remote().result(timeout_s=60)["up_s"] > started_s  # the same replica
