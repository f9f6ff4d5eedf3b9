"""A start that fails leaves nothing behind: the local Ray cluster ``start`` brought up goes down
with its error, so the caller (a test, a benchmark, a notebook) can start again in the same process."""

from __future__ import annotations

import pytest
import yaml

from app.config import DEFAULT_CONFIG_PATH

pytestmark = [pytest.mark.ray]


def test_a_deploy_that_fails_takes_down_the_local_cluster_it_started(tmp_path, monkeypatch):
    import ray

    from app.ports import free_port
    from deployments.launch import start, stop

    monkeypatch.setenv("FORESERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["applications"][0]["import_path"] = "deployments.no_such_module:build_app"  # Serve's build fails
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data))

    failed = "(?s)Serve could not deploy 'foreserve' \\(DEPLOY_FAILED\\): .*No module named 'deployments.no_such_module'"
    with pytest.raises(RuntimeError, match=failed):
        start(str(path), port=free_port())
    assert not ray.is_initialized()
    stop()  # as a caller's cleanup does: nothing left to stop, and no cluster started to stop it
    assert not ray.is_initialized()
    ray.init(num_cpus=1, include_dashboard=False)  # what failed before: "Maybe you called ray.init twice"
    ray.shutdown()
