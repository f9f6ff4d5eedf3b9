"""The cluster's registry: ``foreserve predictor server``'s MLflow server with the predictors' files in
the store (a real S3-compatible server), served through it, so that a client with no shared disk
registers a version and another one, elsewhere, loads it."""

from __future__ import annotations

import os
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


def _shm() -> set[str]:
    """What in /dev/shm is MLflow's (its job queue's folders hold ``*.mlflow-huey-store`` files);
    other processes of the test session (a Ray cluster) may add their own meanwhile."""
    if not os.path.isdir("/dev/shm"):
        return set()
    found = set()
    for entry in os.listdir("/dev/shm"):
        path = os.path.join("/dev/shm", entry)
        try:
            names = os.listdir(path) if os.path.isdir(path) else [entry]
        except OSError:
            continue
        if any("mlflow" in name for name in names):
            found.add(entry)
    return found


def test_a_stopped_server_leaves_no_process_and_nothing_in_dev_shm(tmp_path: Path):
    """MLflow's server starts a job runner (GenAI evaluation jobs) whose queue lives in a folder it
    makes in /dev/shm and never removes: memory leaked per start on an operator's machine. The
    registry needs no jobs: nothing may be left in /dev/shm, nor any of its processes."""
    before = _shm()
    server = TrackingServer(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts"), port=free_port(),
                            log_path=tmp_path / "mlflow.log")
    with server:
        group = server.process.pid
        from mlflow import MlflowClient

        # the registry URI too: predictor.registry.configure() set MLflow's global one to an earlier store
        assert MlflowClient(server.url, registry_uri=server.url).search_registered_models() == []
    assert _shm() - before == set(), "left in /dev/shm"
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == group]
    assert alive == [], f"processes of the server's group still running: {alive}"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_a_stopped_registry_server_is_noticed_within_a_poll_and_the_champion_keeps_serving(tmp_path: Path):
    """The registry's MLflow server stops (a real one, its processes gone) and comes back on the same
    port and database: the predictor serves its champion throughout, a poll during the outage reports
    it within seconds (``/health`` says ``degraded``, ``deployments/health.py``) instead of waiting
    through MLflow's retries, and the first poll after the restart clears it."""
    from deployments.predictor import LengthPredictorServer

    port, db = free_port(), f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = Store(tmp_path / "replica", f"http://127.0.0.1:{port}")
    seen: list[bool] = []
    with TrackingServer(db, str(tmp_path / "artifacts"), port=port, log_path=tmp_path / "mlflow.log"):
        train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=Store(tmp_path / "trainer", store.uri()))
        server = LengthPredictorServer({"poll_s": 3600}, store=store, on_registry=seen.append)  # polled by hand
    try:
        assert server.version == "1"
        assert not server.refresh()  # the server is gone
        # the store's /health probe said so (Store.check_answers), not MLflow's client after minutes of retries
        assert server.registry_error is not None and "ConnectionError" in server.registry_error, server.registry_error
        assert "does not answer" in server.registry_error, server.registry_error
        assert [p["version"] for p in server.predict_batch(["hi", "write an essay"])] == ["1", "1"]
        with TrackingServer(db, str(tmp_path / "artifacts"), port=port, log_path=tmp_path / "mlflow-2.log"):
            assert not server.refresh() and server.registry_error is None  # back, the same champion
        assert seen == [False, True]
    finally:
        server.close()
