"""The ``registry_outage`` scenario: the predictor registry's MLflow server stopped under load, then
started again. ``foreserve chaos`` then serves the registry of its data dir through an MLflow server
of its own (``registry_server``, the way a cluster runs it: ``foreserve predictor server``) and gives
the service its URL; the fault stops that server for ``DOWN_S``, longer than the predictor's poll
period, and starts it again on the same port. What must hold: the champion already loaded keeps
predicting (no fallback), ``/health`` says ``degraded`` at the next poll and ``ok`` after the restart."""

from __future__ import annotations

import threading
from pathlib import Path

from app.ports import free_port
from predictor.store import Store
from predictor.tracking_server import TrackingServer

DOWN_S = 45.0  # past the predictor's poll period (serve_config.yaml: predictor.poll_s, 30 s)
NOTICE_S = 60.0  # how long /health may take to say so: a poll period, and the server's /health timeout


def registry_server(home: Path, log_path: Path) -> TrackingServer:
    """An MLflow server (started) on the data dir's own registry store and artifacts."""
    store = Store(home)
    server = TrackingServer(store.uri(), str(store.artifact_root()), port=free_port(), log_path=log_path)
    server.start()
    return server


def outage(server: TrackingServer, down_s: float = DOWN_S) -> list[int]:
    """Stop ``server`` now and start it again after ``down_s`` (in the background); the pid it stopped."""
    pid = server.process.pid if server.process else None
    server.stop()
    restart = threading.Timer(down_s, server.start)
    restart.daemon = True  # NOTE: never keeps the command alive after the run
    restart.start()
    return [pid] if pid else []
