"""Start Ray (local, or the cluster at ``RAY_ADDRESS``) and deploy serve_config.yaml's foreserve app, as
``foreserve serve`` does; the load tests and benchmarks start it the same way.

The environment the replicas get (``app.runtime_env.SERVE_ENV``) is read here, where Ray is started."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from pathlib import Path

from app.runtime_env import SERVE_ENV, env_vars


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a service started on the side)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float, app_name: str | None = None) -> None:
    """Poll ``GET /health`` until the app and both pools answer (Serve's proxy 404s until routes exist);
    with ``app_name``, fail at once with Serve's message if the deployment failed."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{url}/health")
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if response.status == 200 and json.loads(response.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        if app_name:
            _raise_if_failed(app_name)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app did not answer at {url} within {timeout_s:.0f} s; see the Ray logs above")
        time.sleep(0.5)


def _raise_if_failed(app_name: str) -> None:
    from ray import serve

    status = serve.status().applications.get(app_name)
    if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
        raise RuntimeError(f"Serve could not deploy {app_name!r} ({status.status}): {status.message}")


def application_schema(path: Path, env: dict[str, str]) -> dict:
    """serve_config.yaml's foreserve application, as Serve's config API takes it, with ``env`` added
    to its runtime_env (the replicas, the builder task and the controller-side autoscaling policy)."""
    from app.config import APP_NAME, app_entry

    entry = dict(app_entry(path))
    entry.setdefault("name", APP_NAME)
    entry.setdefault("route_prefix", "/")
    entry.setdefault("import_path", "deployments.builder:build_app")
    runtime_env = dict(entry.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
    entry["runtime_env"] = runtime_env
    return entry


def start(config_path: str | None = None, host: str | None = None, port: int | None = None):
    """Start Ray (local, or ``RAY_ADDRESS``) and deploy the app; returns (url, seconds taken, AppConfig).

    The config file is deployed as Ray's ``serve deploy`` does (Serve's declarative config API), so
    everything in it applies: per-deployment options and autoscaling, and the application-level
    autoscaling policy that only that path supports."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from app.config import DEFAULT_CONFIG_PATH, AppConfig, load_yaml

    t0 = time.perf_counter()
    path = Path(config_path) if config_path else DEFAULT_CONFIG_PATH
    top = load_yaml(path)
    http = {"host": "127.0.0.1", "port": 8000, **(top.get("http_options") or {})}
    if host:
        http["host"] = host
    if port:
        http["port"] = port
    if not os.environ.get("RAY_ADDRESS"):
        # NOTE: Ray 2.60 turns on token auth by default; a private local cluster runs without it
        # (joining a cluster with auth: export RAY_AUTH_TOKEN and RAY_ADDRESS instead).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = env_vars(SERVE_ENV)
    entry = application_schema(path, env)
    config = AppConfig.model_validate(entry.get("args") or {})  # fail fast, before starting anything
    proxy_location = top.get("proxy_location", "HeadOnly")
    schema = ServeDeploySchema.model_validate(
        {"proxy_location": proxy_location, "http_options": http, "applications": [entry]}
    )
    # NOTE: the dashboard serves the Jobs API that batch jobs (and /v1/batches) are submitted to
    ray.init(runtime_env={"env_vars": env}, include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True)
    serve.start(proxy_location=proxy_location, http_options=http)
    _get_global_client().deploy_apps(schema, _blocking=False)
    url = f"http://{http['host']}:{http['port']}"
    wait_ready(url, 180, entry["name"])
    return url, time.perf_counter() - t0, config


def metrics_urls() -> list[str]:
    """Each Ray node's Prometheus endpoint (foreserve's metrics are ``ray_foreserve_*``)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes() if n.get("Alive")]


def stop() -> None:
    """Shut Serve and Ray down (what ``start`` started)."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
