"""An MLflow tracking server for a cluster's predictor registry: every node reaches one registry over
HTTP, and the server proxies the artifacts (``--serve-artifacts``), so no node reads another's disk.

The single-machine default stays the sqlite store under the data dir (``predictor.store.Store``);
on a cluster the operator runs this once (``foreserve predictor server``) on a backend every
replica outlives, PostgreSQL for instance, and exports ``MLFLOW_TRACKING_URI`` to its URL.

MLflow's server forks gunicorn/uvicorn workers: it runs in a process group of its own, so that
stopping it stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrackingServer:
    """``mlflow server`` on ``backend_uri`` (``postgresql://…``, ``sqlite:///…``) with artifacts kept
    under ``artifacts`` (a folder or a URI MLflow writes, e.g. ``s3://bucket/prefix``) and served."""

    backend_uri: str
    artifacts: str
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 2
    log_path: Path | None = None
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        """The tracking URI clients use (``MLFLOW_TRACKING_URI``)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        artifacts = self.artifacts if "://" in self.artifacts else str(Path(self.artifacts).resolve())
        return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend_uri,
                "--serve-artifacts", "--artifacts-destination", artifacts,
                "--host", self.host, "--port", str(self.port), "--workers", str(self.workers)]

    def start(self, timeout_s: float = 120.0) -> str:
        """Start the server and wait until it answers ``/health``; returns its URL."""
        if self.process is not None:
            raise RuntimeError(f"the tracking server at {self.url} is already started")
        # NOTE: no job runner (GenAI evaluation jobs, which a registry never runs): it keeps its queue
        # in a folder it makes under /dev/shm and never removes, and adds processes
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        try:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        finally:
            if self.log_path:
                out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                where = f"; its log: {self.log_path}" if self.log_path else ""
                raise RuntimeError(f"mlflow server exited with code {code} before answering{where}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200 and self.process.poll() is None:  # ours, not another's port
                        return self.url
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer at {self.url}/health within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server and its workers: SIGTERM to its process group, SIGKILL after ``timeout_s``.
        Returns once no process of the group is left (uvicorn's workers and its resource tracker
        outlive the ``mlflow`` process that leads the group by a moment)."""
        if self.process is None:
            return
        process, self.process = self.process, None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout_s)
            if _group_gone(process.pid, timeout_s):
                break

    def __enter__(self) -> "TrackingServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process is in group ``pgid`` (zombies included: an orphan is reaped by init a
    moment after its parent ends); False if some are left after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
