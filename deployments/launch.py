"""Start Ray (local, or the cluster at ``RAY_ADDRESS``) and deploy serve_config.yaml's foreserve app, as
``foreserve serve`` does; the load tests and benchmarks start it the same way.

The environment the replicas get (``app.runtime_env.SERVE_ENV``) is read here, where Ray is started."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from app import paths
from app.api.keys import digest, split_list
from app.runtime_env import SERVE_ENV, env_vars
from deployments.health import is_serving


def wait_ready(url: str, timeout_s: float, app_name: str | None = None) -> dict:
    """Poll ``GET /health`` until the app and both pools answer (Serve's proxy 404s until routes exist);
    with ``app_name``, fail at once with Serve's message if the deployment failed. Returns the last
    health answer: ``ok``, or ``degraded`` only because the predictor serves max reservation (the
    service answers; the caller shows why)."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{url}/health")
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                health = json.loads(response.read()) if response.status == 200 else {}
            if is_serving(health):
                return health
        except (OSError, ValueError):
            pass
        if app_name:
            _raise_if_failed(app_name)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app did not answer at {url} within {timeout_s:.0f} s; see the Ray logs above")
        time.sleep(0.5)


def _raise_if_failed(app_name: str) -> None:
    from deployments.pool_gate import serve_status

    status = serve_status().applications.get(app_name)
    if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
        name = getattr(status.status, "value", status.status)  # the name alone, not the enum's repr
        raise RuntimeError(f"Serve could not deploy {app_name!r} ({name}): {status.message}")


def replica_env(joined: bool) -> dict[str, str]:
    """The environment the replicas get (their runtime_env, which Ray's dashboard shows): this
    process's ``SERVE_ENV`` variables, with ``FORESERVE_API_KEYS`` as SHA-256 digests only, and,
    when joining a cluster, without ``FORESERVE_HOME`` (every node keeps its own data dir)."""
    env = env_vars(SERVE_ENV)
    if keys := split_list(os.environ.get("FORESERVE_API_KEYS")):
        env["FORESERVE_API_KEY_SHA256"] = ",".join([*split_list(env.get("FORESERVE_API_KEY_SHA256")), *map(digest, keys)])
    if joined:
        env.pop("FORESERVE_HOME", None)
    return env


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


def check_registry_reachable_from_every_node(nodes: int, tracking_uri: str) -> None:
    """On a cluster of several nodes, the predictor's registry must be one every node reaches: a
    node-local store (the default sqlite file under the data dir) would give every other node an
    empty registry of its own, and its replicas would serve ``max-fallback``."""
    scheme = tracking_uri.split(":", 1)[0]
    if nodes > 1 and scheme in ("sqlite", "file", ""):
        raise RuntimeError(
            f"this Ray cluster has {nodes} nodes, but the predictor registry is {tracking_uri}, on this node's disk: "
            "replicas on the other nodes would not find the champion. Run one registry every node reaches "
            "(`foreserve predictor server --backend-store-uri postgresql://… --artifacts DIR`, docs/cluster.md) "
            "and export MLFLOW_TRACKING_URI=http://HOST:5000 before `foreserve serve`.")


_deployed: dict[str, str | bool] = {}  # what start() deployed, for stop(): the app's name, and whether Ray was joined


def head_address() -> str:
    """The head node's IP address, as Ray knows it."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeManagerAddress"]
    raise RuntimeError("no live head node in this Ray cluster")


def check_replicas_fit_a_node(deployments: list[dict], nodes: list[dict]) -> None:
    """Every deployment whose replica must sit on one node (``placement_group_strategy: STRICT_PACK``,
    a tensor-parallel pool: the replica's bundle and one per rank) needs a node that holds all its
    bundles; else Serve would wait for it forever. ``nodes``: ``ray.nodes()``."""
    capacity = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    for deployment in deployments:
        bundles = deployment.get("placement_group_bundles") or []
        if len(bundles) < 2 or deployment.get("placement_group_strategy") != "STRICT_PACK":
            continue
        need: dict[str, float] = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                need[key] = need.get(key, 0.0) + amount
        if not any(all(node.get(key, 0.0) >= amount - 1e-9 for key, amount in need.items()) for node in capacity):
            largest = max(capacity, key=lambda node: node.get("CPU", 0.0), default={})
            have = {k: largest.get(k, 0.0) for k in need}
            raise RuntimeError(
                f"deployment {deployment.get('name')!r} packs its replica and tensor-parallel ranks on one node "
                f"(STRICT_PACK) and needs {need}, but no node of this cluster has that much (the largest has {have}): "
                "lower tensor_parallel_size or the bundles, or add a bigger node")


def start(config_path: str | None = None, host: str | None = None, port: int | None = None,
          proxy_location: str | None = None, model: str | None = None):
    """Start Ray (local, or join the cluster at ``RAY_ADDRESS``) and deploy the app; returns (url,
    seconds taken, AppConfig).

    The config file is deployed as Ray's ``serve deploy`` does (Serve's declarative config API), so
    everything in it applies: per-deployment options and autoscaling, and the application-level
    autoscaling policy that only that path supports. Joined to a cluster, the app listens on every
    interface with a proxy on every node (unless ``host``/``proxy_location`` say otherwise), and
    the URL returned is the head's. A start that fails takes the local cluster it started down with
    it; a joined cluster is only left, a failed deploy still there for ``serve status``."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from app.config import DEFAULT_CONFIG_PATH, AppConfig, load_yaml
    from app.ray_local import init_local, join_cluster

    t0 = time.perf_counter()
    path = Path(config_path) if config_path else DEFAULT_CONFIG_PATH
    top = load_yaml(path)
    joined = bool(os.environ.get("RAY_ADDRESS"))
    http = {"host": "127.0.0.1", "port": 8000, **(top.get("http_options") or {})}
    if joined:
        http["host"] = "0.0.0.0"  # NOTE: clients and the other nodes' proxies are on other machines
    if host:
        http["host"] = host
    if port:
        http["port"] = port
    if not os.environ.get("RAY_ADDRESS"):
        # NOTE: Ray 2.60 turns on token auth by default; a private local cluster runs without it
        # (joining a cluster with auth: export RAY_AUTH_TOKEN and RAY_ADDRESS instead).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = replica_env(joined)
    entry = application_schema(path, env)
    if model:  # `foreserve serve --model`: the app's model, for every pool that names none
        entry["args"] = {**(entry.get("args") or {}), "model": model}
    config = AppConfig.model_validate(entry.get("args") or {})  # fail fast, before starting anything
    proxy_location = proxy_location or ("EveryNode" if joined else top.get("proxy_location", "HeadOnly"))
    schema = ServeDeploySchema.model_validate(
        {"proxy_location": proxy_location, "http_options": http, "applications": [entry]}
    )
    # NOTE: the dashboard serves the Jobs API that batch jobs (and /v1/batches) are submitted to
    options = {"runtime_env": {"env_vars": env}, "include_dashboard": True, "dashboard_host": "127.0.0.1",
               "log_to_driver": True}
    if joined:  # NOTE: a head whose GCS is down fails here in seconds (Ray would retry for minutes)
        join_cluster(os.environ["RAY_ADDRESS"], **options)
    else:  # NOTE: a local cluster left dead by a crash: start a fresh one
        init_local(**options)
    try:
        nodes = ray.nodes()
        check_registry_reachable_from_every_node(sum(1 for n in nodes if n.get("Alive")), paths.predictor_store().uri())
        check_replicas_fit_a_node(entry.get("deployments") or [], nodes)
        if joined:  # every node that may run a replica: code, versions, store, registry and the model
            from deployments.preflight import preflight

            for report in preflight(config, env):
                if report["model_fetched"]:
                    print(f"node {report['node_ip']}: fetched the model from the store", file=sys.stderr, flush=True)
        serve.start(proxy_location=proxy_location, http_options=http, controller_options=top.get("controller_options"))
        client = _get_global_client()
        if joined:  # a declarative deploy deletes the declarative apps it leaves out: keep the others'
            others = other_declarative_apps(client.get_serve_details(), entry["name"])
            schema = ServeDeploySchema.model_validate({**schema.model_dump(exclude_unset=True),
                                                       "applications": [*others, entry]})
        client.deploy_apps(schema, _blocking=False)
        _deployed.update(app=entry["name"], joined=joined)
        # NOTE: on a cluster where Serve already runs, its HTTP options are the ones it started with
        listen, listen_port = client.http_config.host, client.http_config.port
        url = f"http://{head_address() if listen in ('0.0.0.0', '::') else listen}:{listen_port}"
        health = wait_ready(url, 180, entry["name"])
        for problem in health.get("problems") or []:
            print(f"foreserve is degraded: {problem}", file=sys.stderr, flush=True)
    except BaseException:  # a failed start takes down what it started, so that the caller may start again
        _deployed.clear()  # a joined cluster is only left: a failed deploy stays for `serve status`
        if not joined:
            try:
                stop()  # the local cluster it started, with Serve
            except Exception as e:  # noqa: BLE001 - the start's own error is the one to raise
                print(f"foreserve: Serve did not shut down cleanly ({type(e).__name__}: {e})", file=sys.stderr,
                      flush=True)
        ray.shutdown()
        raise
    return url, time.perf_counter() - t0, config


def other_declarative_apps(details: dict, ours: str) -> list[dict]:
    """The configs of the applications other people deployed from config files (``serve deploy``) on
    the cluster, as Serve's details report them, without ``ours``: Serve's declarative API deletes
    every declarative app a new config leaves out, so foreserve's deploy carries them along."""
    return [app["deployed_app_config"] for name, app in (details.get("applications") or {}).items()
            if name != ours and app.get("source") == "declarative" and app.get("deployed_app_config")]


def metrics_urls() -> list[str]:
    """Each Ray node's Prometheus endpoint (foreserve's metrics are ``ray_foreserve_*``)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes() if n.get("Alive")]


def drain(timeout_s: float, interrupted: Callable[[], bool] = lambda: False, poll_s: float = 0.5) -> int:
    """Drain the app's ingress (``Ingress.drain``: new requests get 503 with Retry-After) and wait
    until its open requests are answered, at most ``timeout_s`` or until ``interrupted()``; returns
    how many were still open (0: none cut)."""
    from ray import serve

    if not _deployed.get("app"):
        return 0
    try:
        ingress = serve.get_app_handle(str(_deployed["app"]))
        left = ingress.drain.remote().result(timeout_s=30)
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline and not interrupted():
            time.sleep(poll_s)
            left = ingress.open_requests.remote().result(timeout_s=30)
    except Exception as exc:  # noqa: BLE001 - no ingress to ask (it died, or never came up): stop anyway
        print(f"could not drain the ingress ({type(exc).__name__}: {exc}); stopping", file=sys.stderr, flush=True)
        return 0
    return left


def stop() -> None:
    """Take down what ``start`` started: on a cluster it joined, foreserve's app only (Serve and the
    other apps there keep running); on the local cluster it started, Serve and Ray."""
    import ray
    from ray import serve

    if not ray.is_initialized():  # nothing up (a start that failed took its cluster down)
        _deployed.clear()
        return
    if _deployed.get("joined"):
        serve.delete(str(_deployed["app"]))
    else:
        serve.shutdown()
    _deployed.clear()
    ray.shutdown()
