"""The predictor's registry seen from another node: a predictor replica pinned to a worker node whose
data dir holds the model and nothing else.

With the single-machine default (sqlite under each node's data dir) the replica finds an empty
registry of its own and serves ``max-fallback``: ``/health`` must say so, and ``foreserve serve``
refuses that setup on a cluster before deploying. With an MLflow tracking server on PostgreSQL that
serves the artifacts, the replica serves the champion."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.ports import free_port
from deployments.launch import check_registry_reachable_from_every_node
from predictor.store import Store
from predictor.training.pipeline import train_and_register
from tests.services import postgres
from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.mlflow, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _predictor_info(cluster, node: str, env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Deploy the predictor alone on ``node`` (with ``env`` added to its environment); its ``info()``
    and one prediction."""
    from ray import serve

    from deployments.predictor import PredictorDeployment

    options = {**cluster.pin(node), "runtime_env": {"env_vars": env or {}}}
    app = PredictorDeployment.options(ray_actor_options=options).bind({"source": "champion", "retrain_enabled": False})
    serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on port 8000
    handle = serve.run(app, name="predictor-on-a-node", route_prefix=None)
    try:
        return handle.info.remote().result(timeout_s=180), handle.predict.remote("write me a poem").result(timeout_s=60)
    finally:
        serve.delete("predictor-on-a-node")


def test_a_node_local_registry_leaves_other_nodes_without_the_champion(cluster, tmp_path: Path):
    head = Store(cluster.homes["head"])  # the single-machine default: sqlite in the head's data dir
    assert train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=head)["promoted"]

    info, prediction = _predictor_info(cluster, "node_b")
    assert prediction["version"] == info["version"] == "max-fallback"
    assert "no champion" in info["unavailable"] and str(cluster.homes["node_b"]) in info["unavailable"]

    with pytest.raises(RuntimeError, match="4 nodes, but the predictor registry is sqlite:///.*foreserve predictor server"):
        check_registry_reachable_from_every_node(4, head.uri())
    check_registry_reachable_from_every_node(1, head.uri())  # one machine: the default is right
    check_registry_reachable_from_every_node(4, "http://10.0.0.1:5000")


def test_a_tracking_server_on_postgres_serves_the_champion_on_every_node(cluster, tmp_path: Path):
    from predictor.tracking_server import TrackingServer

    with postgres() as database:
        server = TrackingServer(database, str(tmp_path / "artifacts"), port=free_port(), log_path=tmp_path / "mlflow.log")
        with server:
            store = Store(tmp_path / "driver", server.url)  # the driver's own data dir: nothing shared on disk
            first = train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=store)
            assert first["version"] == "1" and first["promoted"]

            info, prediction = _predictor_info(cluster, "node_c", {"MLFLOW_TRACKING_URI": server.url})
            assert info["version"] == prediction["version"] == "1" and info["unavailable"] is None
            # the replica downloaded the version through the server into its own node's cache
            assert (cluster.homes["node_c"] / "mlflow" / "cache" / "1").is_dir()
            assert not (tmp_path / "driver" / "mlflow" / "artifacts").exists()
