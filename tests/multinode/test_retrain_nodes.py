"""Feedback written on one worker node retrains the predictor exactly once for the cluster.

Two predictor replicas on two worker nodes (each node with a data dir of its own), the registry an
MLflow tracking server, the feedback in a store every node sees (a shared folder: the ``file://``
variant of the store). A task on a third node writes the feedback. Exactly one retrain must run
(the replicas' triggers meet in one named actor) and no second one may start without new records
(the watermark is a registered-model tag, read alike on every node)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.ports import free_port
from predictor.object_store import ObjectStore
from predictor.store import Store
from predictor.tracking_server import TrackingServer
from predictor.training.pipeline import train_and_register
from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.mlflow, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

POLICY = {"min_records": 10, "every_records": 20, "original_examples": 0, "holdout_frac": 0.3, "epochs": 1,
          "gate": False, "retry_after_s": 3600, "num_cpus": 1}


def _write_feedback(store: ObjectStore, n: int) -> str:
    """On the node it runs on: ``n`` finished requests' feedback, as an engine writes it."""
    import socket

    from predictor.feedback import FeedbackRecord, FeedbackWriter

    with FeedbackWriter(store, flush_s=0.05) as writer:
        for i in range(n):
            long = i % 2 == 0
            writer.append(FeedbackRecord(
                request_id=f"r{i}", prompt=f"{'tell me everything about' if long else 'yes or no:'} topic {i}",
                predicted_bucket=0, predicted_bound_tokens=102, output_tokens=700 if long else 3, finish_reason="stop",
                tier="online", model_id="SmolLM2-135M-Instruct", predictor_version="1"))
    return socket.gethostname()


def test_feedback_on_a_worker_node_retrains_once_for_the_cluster(cluster, tmp_path: Path):
    import ray
    from mlflow import MlflowClient
    from ray import serve

    from deployments.predictor import PredictorDeployment

    shared = ObjectStore(tmp_path / "store")  # every node of this machine sees it: the file:// variant
    server = TrackingServer(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts"), port=free_port(),
                            log_path=tmp_path / "mlflow.log")
    with server:
        store = Store(tmp_path / "driver", server.url)
        assert train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=store)["version"] == "1"
        config = {"source": "champion", "poll_s": 1.0, "retrain": POLICY}
        env = {"MLFLOW_TRACKING_URI": server.url}
        app = PredictorDeployment.options(num_replicas=2, ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": env}})
        serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on port 8000
        handle = serve.run(app.bind(config, shared.uri), name="retrain-nodes", route_prefix=None)
        try:
            assert handle.info.remote().result(timeout_s=180)["version"] == "1"
            # two replicas fill two of the three 1-CPU worker nodes; the retrain task gets the third
            writer = ray.remote(num_cpus=0, resources={"node_a": 0.01})(_write_feedback)
            ray.get(writer.remote(shared.child("feedback"), 30), timeout=60)

            client = MlflowClient(server.url, server.url)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and len(client.search_model_versions("name='length-predictor'")) < 2:
                time.sleep(1)
            versions = client.search_model_versions("name='length-predictor'")
            assert {v.version for v in versions} == {"1", "2"}
            assert client.get_model_version("length-predictor", "2").tags["source"] == "feedback"

            time.sleep(10)  # ten more polls of each replica: no new records, so no second retrain
            assert len(client.search_model_versions("name='length-predictor'")) == 2
            infos = [handle.info.remote().result(timeout_s=60) for _ in range(8)]
            assert {i["retrains_submitted"] for i in infos} == {1}
            assert {i["retrain_coordinator"] for i in infos} == {"retrain-nodes-retrain"}
            assert {i["last_retrain"]["version"] for i in infos} == {"2"}
            watermark = client.get_registered_model("length-predictor").tags["retrain_watermark_s"]
            assert float(watermark) > 0
        finally:
            serve.delete("retrain-nodes")
