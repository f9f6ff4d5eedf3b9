"""Shared fixtures, and the rules of the three tiers.

tests/unit   no model, no prepared data, no Ray, MLflow or Locust: runs on `make install` alone.
             `make test-unit` proves it: an empty FORESERVE_HOME, and those packages (and the data
             packages the model and traces are prepared from) hidden by tests/import_blocker.
tests/model  the real SmolLM2 weights or the ShareGPT traces that `make prepare` writes (markers
             ``model``, ``traces``); no Ray, MLflow, Locust or DeepSpeed rank processes.
tests/e2e    Ray or Serve, MLflow, Locust, DeepSpeed's rank processes (markers ``ray``, ``mlflow``,
             ``locust``, ``deepspeed``), often with the model or traces too.
tests/multinode  a Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), each
             node with a data dir of its own (marker ``multinode``; the ``cluster`` fixture).

A test's markers say what it needs (registered in pyproject.toml); the collection check below fails
the run when a test sits in a tier its markers rule out, so a marker and a folder cannot drift apart.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
NEEDS = ("model", "traces", "ray", "mlflow", "locust", "deepspeed", "multinode")
# tier -> (markers a test there must carry at least one of, markers it must not carry)
TIERS = {
    "unit": ((), NEEDS),
    "model": (("model", "traces"), ("ray", "mlflow", "locust", "deepspeed", "multinode")),
    "e2e": (("ray", "mlflow", "locust", "deepspeed"), ("multinode",)),
    "multinode": (("multinode",), ()),
}
BLOCK_ENV = "FORESERVE_BLOCK_IMPORTS"


def blocked_modules() -> set[str]:
    """The modules `make test-unit` hides (tests/import_blocker/sitecustomize.py), if it does."""
    return {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}


_PLUGINS: list = []  # the session's plugin manager, for pytest_runtest_logreport


def pytest_configure(config: pytest.Config) -> None:
    _PLUGINS[:] = [config.pluginmanager]
    blocked = blocked_modules()
    if not blocked:
        return
    hider = sys.modules.get("sitecustomize")
    if not hasattr(hider, "HidingFinder"):
        raise pytest.UsageError(f"{BLOCK_ENV} is set but nothing hides those modules: put tests/import_blocker "
                                "first on PYTHONPATH, as `make test-unit` does")
    hider.install()  # again: pytest put its assertion-rewriting import hook in front since start-up
    assert all(isinstance(f, hider.HidingFinder) for f in sys.meta_path)
    loaded = sorted(n for n in blocked if n in sys.modules)
    if loaded:
        raise pytest.UsageError(f"{', '.join(loaded)} imported before the blocker: disable the plugin that imports it")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failed test that drives Ray is printed as it fails: Ray can end a driver's process (exit 1,
    nothing printed) before pytest's summary, which would take the failure with it."""
    if not report.failed or "ray" not in report.keywords:
        return
    terminal = _PLUGINS[0].get_plugin("terminalreporter") if _PLUGINS else None
    if terminal is not None:
        terminal.write_sep("-", f"{report.nodeid} failed in its {report.when} (the summary repeats it)", red=True)
        terminal.write_line(report.longreprtext)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        try:
            tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue  # not under tests/
        if tier not in TIERS:
            wrong.append(f"{item.nodeid}: outside tests/unit, tests/model and tests/e2e")
            continue
        need_one, forbidden = TIERS[tier]
        marks = {m.name for m in item.iter_markers()}
        if need_one and not marks & set(need_one):
            wrong.append(f"{item.nodeid}: in tests/{tier} without any of the markers {', '.join(need_one)}")
        if marks & set(forbidden):
            wrong.append(f"{item.nodeid}: in tests/{tier} but marked {', '.join(sorted(marks & set(forbidden)))}")
    if wrong:
        raise pytest.UsageError("tests in the wrong tier for their markers (see tests/conftest.py):\n  " + "\n  ".join(wrong))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private data dir (FORESERVE_HOME) with an empty MLflow store folder, and no tracking URI from
    the environment: what a test writes (predictor versions, feedback, reports) stays in it."""
    home = tmp_path / "home"
    (home / "mlflow").mkdir(parents=True)
    monkeypatch.setenv("FORESERVE_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


@pytest.fixture
def home_with_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private data dir like ``home`` with the prepared model and traces linked in, read-only: a
    service started there serves the model, and a load test draws its prompts from the traces
    (which it would otherwise build again, two minutes here)."""
    from tests.homes import link_prepared

    home = link_prepared(tmp_path / "home")
    monkeypatch.setenv("FORESERVE_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


@pytest.fixture(scope="session")
def s3_uri() -> str:
    """The URI of a bucket on a real S3-compatible server process (moto), shared by the session."""
    from tests.services import s3_server

    with s3_server() as uri:
        yield uri


@pytest.fixture(params=["local", "s3"])
def object_store(request: pytest.FixtureRequest, tmp_path: Path):
    """A fresh, empty ``ObjectStore``: a local folder, and a prefix of its own on the S3 server."""
    from predictor.object_store import ObjectStore

    if request.param == "local":
        return ObjectStore(tmp_path / "store")
    return ObjectStore(request.getfixturevalue("s3_uri")).child(f"t-{tmp_path.name}")


@dataclass
class LocalCluster:
    """A Ray cluster of several nodes on this machine: a head with no CPUs (it runs Serve's controller
    and proxy and nothing else) and 1-CPU workers, each with a data dir of its own (``homes``: its
    ``FORESERVE_HOME``, given through the node's environment; the driver's is not forwarded) that
    holds the prepared model and nothing else, and a custom resource named after it that pins work
    there (``{"node_b": 0.01}``)."""

    cluster: object  # ray.cluster_utils.Cluster
    homes: dict[str, Path]
    address: str

    @property
    def head_ip(self) -> str:
        return self.cluster.head_node.node_ip_address

    def pin(self, node: str) -> dict:
        """``ray_actor_options`` that place an actor (a Serve replica) on ``node``."""
        return {"resources": {node: 0.01}}


WORKERS = ("node_a", "node_b", "node_c")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A head and three worker nodes (``LocalCluster``), connected; shut down after the module."""
    with _local_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture(scope="module")
def s3_cluster(tmp_path_factory: pytest.TempPathFactory, s3_uri: str):
    """``cluster``, with the S3 server's credentials (``tests.services.S3_ENV``) in every node's
    environment, so that a store at ``s3_uri`` opens on any node, and the head's dashboard (the Ray
    Jobs API) on a free port of every interface, where each node finds it as on a real cluster."""
    from app.ports import free_port
    from tests.services import S3_ENV

    head = {"include_dashboard": True, "dashboard_host": "0.0.0.0", "dashboard_port": free_port()}
    with _local_cluster(tmp_path_factory.mktemp("cluster"), S3_ENV, head) as started:
        yield started


GCS_RECONNECT_S = 400  # how long nodes and drivers wait for a lost GCS (Ray's default: 60 s): past
# the outage test's longest wait on a 2-core machine whose head spends the cores retrying it


@pytest.fixture(scope="module")
def gcs_ft_cluster(tmp_path_factory: pytest.TempPathFactory):
    """``cluster`` with Ray's GCS fault tolerance: the head keeps the GCS's tables in a Redis server
    (``tests.services.redis``; ``RAY_REDIS_ADDRESS``, read as the head starts) and its GCS on a fixed
    port, so that a GCS restarted with ``cluster.cluster.head_node.start_gcs_server()`` is found where
    the nodes left it; they wait ``GCS_RECONNECT_S`` for it.

    NOTE: no dashboard on the head. While the GCS is down, Ray's dashboard (its NodeHead module)
    polls it without pause, most of a core on this 2-core machine that the engines need; on a real
    cluster it spins on the head, not on the engines' nodes (docs/cluster.md)."""
    from app.ports import free_port
    from tests.services import redis

    with redis() as address, pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_REDIS_ADDRESS", address)
        mp.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", str(GCS_RECONNECT_S))  # nodes inherit it
        head = {"gcs_server_port": free_port(), "include_dashboard": False}
        with _local_cluster(tmp_path_factory.mktemp("cluster"), head_args=head) as started:
            yield started


@contextlib.contextmanager
def _local_cluster(root: Path, env: dict[str, str] | None = None, head_args: dict | None = None) -> Iterator[LocalCluster]:
    """The nodes of ``LocalCluster`` under ``root``, ``env`` added to each node's environment and
    ``head_args`` to the head's ``ray.cluster_utils.Cluster`` arguments; Serve and Ray shut down after."""
    import ray
    from ray.cluster_utils import Cluster

    from app import paths
    from app.ports import free_port

    node_env = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})}
    homes = {}
    for name in ("head", *WORKERS):
        homes[name] = root / name
        (homes[name] / "models").mkdir(parents=True)
        (homes[name] / "models" / paths.model_dir().name).symlink_to(paths.model_dir())  # read-only, prepared once
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")
    mp.delenv("RAY_ADDRESS", raising=False)
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    # NOTE: each node's dashboard agent on a port of its own: Ray's default, 52365, binds once per IP,
    # and a node whose agent cannot bind has no Jobs API agent (another Ray on this machine may hold it)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "resources": {"head": 1}, "env_vars": {**node_env, "FORESERVE_HOME": str(homes["head"])},
        "dashboard_agent_listen_port": free_port(), **(head_args or {})})
    try:
        for name in WORKERS:
            cluster.add_node(num_cpus=1, resources={name: 1}, env_vars={**node_env, "FORESERVE_HOME": str(homes[name])},
                             dashboard_agent_listen_port=free_port())
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield LocalCluster(cluster, homes, cluster.address)
    finally:
        try:
            from ray import serve

            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            cluster.global_state.disconnect()  # NOTE: its GCS client would otherwise outlive the cluster
            mp.undo()
            _forget_cluster(cluster.address)


def _forget_cluster(address: str) -> None:
    """Remove Ray's note of the latest cluster (``/tmp/ray/ray_current_cluster``) when it names this
    one: ``ray.init()`` without an address would otherwise try to join the dead cluster, and every
    later test that starts a Ray of its own would fail."""
    from ray._common.utils import get_ray_address_file

    note = Path(get_ray_address_file(None))
    try:
        if note.read_text().strip() == address:
            note.unlink()
    except OSError:
        pass
