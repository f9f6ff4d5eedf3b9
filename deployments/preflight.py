"""Before foreserve deploys on a cluster: one task on every node that can run a replica checks what
the replicas will need there, and the deploy stops with a message naming each node that fails.

Per node: foreserve's code imports (the task is foreserve code), the versions of foreserve, Ray and
Python match the driver's, the store (``AppConfig.store``) takes a write and gives it back, the
predictor's registry answers, and the model is there, fetched from the store if it is not
(``app.prepare.model_store``), so the first replica on that node starts without the download.
"""

from __future__ import annotations

import time
import uuid

from app.config import AppConfig

TIMEOUT_S = 900.0  # a node fetching the model from the store takes this long at most


def versions() -> dict[str, str]:
    import importlib.metadata
    import platform

    import ray

    return {"foreserve": importlib.metadata.version("foreserve"), "ray": ray.__version__,
            "python": platform.python_version()}


def check_node(config: dict, expected: dict[str, str]) -> dict:
    """Runs on one node (its own environment and data dir): the node's problems, empty when none."""
    import ray

    from app import paths
    from app.prepare.model_store import ensure_local_model

    started = time.monotonic()
    app = AppConfig.model_validate(config)
    problems = []
    found = versions()
    for name, version in expected.items():
        if found.get(name) != version:
            problems.append(f"{name} {found.get(name)} here, {version} on the driver")
    store = paths.store(app.store)
    probe = f".preflight/{uuid.uuid4().hex}"
    try:
        store.put(probe, b"ok")
        if store.get(probe) != b"ok":
            raise OSError("read back something else than was written")
        store.delete(probe)
    except Exception as exc:  # noqa: BLE001 - reported with the node's name
        problems.append(f"store {store.uri}: {type(exc).__name__}: {exc}")
    try:
        from predictor import registry

        registry.champion_version(registry.configure(paths.predictor_store()))
    except Exception as exc:  # noqa: BLE001
        problems.append(f"predictor registry {paths.predictor_store().uri()}: {type(exc).__name__}: {exc}")
    fetched = False
    for model in sorted({pool.model_path for pool in app.pools.values()}):
        had = (model / "config.json").is_file()
        try:
            ensure_local_model(model, store)
            fetched = fetched or not had
        except Exception as exc:  # noqa: BLE001
            problems.append(f"model {model}: {exc}")
    return {"node_ip": ray.util.get_node_ip_address(), "problems": problems, "model_fetched": fetched,
            "seconds": round(time.monotonic() - started, 1)}


def preflight(config: AppConfig, env: dict[str, str], timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Run ``check_node`` on every alive node with CPUs (where replicas go); returns each node's
    report, or raises RuntimeError naming every node that failed and why."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    task = ray.remote(num_cpus=0, max_retries=0)(check_node)
    expected = versions()
    refs = {n["NodeID"]: task.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
        runtime_env={"env_vars": env}).remote(config.model_dump(mode="json"), expected) for n in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    reports, failed = [], []
    for node in nodes:
        name = f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})"
        ref = refs[node["NodeID"]]
        if ref not in ready:
            failed.append(f"{name}: no answer within {timeout_s:.0f} s")
            continue
        try:
            report = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - e.g. foreserve's code is not importable there
            failed.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[-1][:500]}")
            continue
        reports.append({**report, "node_id": node["NodeID"]})
        failed.extend(f"{name}: {problem}" for problem in report["problems"])
    if failed:
        raise RuntimeError("preflight failed on the cluster's nodes; nothing was deployed:\n  " + "\n  ".join(failed))
    return reports
