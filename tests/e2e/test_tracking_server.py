"""The cluster's registry: ``foreserve predictor server``'s MLflow server with the predictors' files in
the store (a real S3-compatible server), served through it, so that a client with no shared disk
registers a version and another one, elsewhere, loads it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from app.ports import free_port
from predictor.model import META
from predictor.object_store import ObjectStore
from predictor.store import Store
from predictor.tracking_server import TrackingServer
from predictor.training.pipeline import train_and_register
from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

pytestmark = [pytest.mark.mlflow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_the_servers_artifacts_live_in_the_store_and_reach_another_client(s3_uri: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    from predictor.loading import load_predictor

    endpoint = parse_qs(urlsplit(s3_uri).query)["endpoint_override"][0]
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", f"http://{endpoint}")  # MLflow's S3 client: a non-AWS endpoint
    prefix = f"mlflow-artifacts-{tmp_path.name}"
    bucket = urlsplit(s3_uri).netloc
    server = TrackingServer(f"sqlite:///{tmp_path / 'mlflow.db'}", f"s3://{bucket}/{prefix}", port=free_port(),
                            log_path=tmp_path / "mlflow.log")
    with server:
        summary = train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=Store(tmp_path / "trainer", server.url))
        assert summary["version"] == "1" and summary["promoted"]
        keys = ObjectStore(s3_uri).keys(prefix)
        assert any(key.endswith(f"/{META}") for key in keys), keys
        assert not (tmp_path / "trainer" / "mlflow" / "artifacts").exists()  # nothing on the trainer's disk

        elsewhere = Store(tmp_path / "node_b", server.url)  # another machine: no credentials needed, only the URL
        monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL")
        predictor = load_predictor("champion", store=elsewhere)
        assert str(predictor.version) == "1" and (tmp_path / "node_b" / "mlflow" / "cache" / "1").is_dir()
