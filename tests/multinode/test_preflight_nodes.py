"""Before deploying on a cluster, one task per node checks what replicas need there: a node without
the model fails the preflight by name until the model is in the store, then fetches it (checked);
a store no node can write fails on every node."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import paths
from app.config import load_app_config
from app.prepare.model_store import upload_model
from deployments.launch import replica_env
from predictor.object_store import ObjectStore

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_a_node_without_the_model_is_named_then_fetches_it_from_the_store(cluster, tmp_path: Path):
    from deployments.preflight import preflight

    bare = tmp_path / "node_d"  # a new machine: foreserve installed, nothing in its data dir
    env = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "FORESERVE_HOME": str(bare)}
    node = cluster.cluster.add_node(num_cpus=1, resources={"node_d": 1}, env_vars=env)
    cluster.cluster.wait_for_nodes()
    try:
        config = load_app_config().model_copy(update={"store": str(tmp_path / "store")})
        with pytest.raises(RuntimeError) as failed:
            preflight(config, replica_env(joined=True))
        lines = str(failed.value).splitlines()
        assert lines[0] == "preflight failed on the cluster's nodes; nothing was deployed:"
        assert len(lines) == 2 and f"model {bare}/models/SmolLM2-135M-Instruct: no model" in lines[1]
        assert "run `foreserve prepare --upload`" in lines[1]

        store = ObjectStore(config.store)
        upload_model(paths.model_dir(), store)
        reports = preflight(config, replica_env(joined=True))
        assert len(reports) == 4 and [r["model_fetched"] for r in reports].count(True) == 1
        fetched = bare / "models" / "SmolLM2-135M-Instruct"
        assert (fetched / "model.safetensors").stat().st_size == (paths.model_dir() / "model.safetensors").stat().st_size
        assert store.keys(".preflight") == []  # the probes are gone

        broken = config.model_copy(update={"store": "/proc/foreserve-store"})  # no node can write there
        with pytest.raises(RuntimeError) as failed:
            preflight(broken, replica_env(joined=True))
        assert sum("store /proc/foreserve-store" in line for line in str(failed.value).splitlines()) == 4
    finally:
        cluster.cluster.remove_node(node)
