"""``GET /health``: what the ingress asks the pools and the predictor, and how it judges the answers.

``ok`` when the predictor and both pools answer within 5 s (a pool the autoscaler scaled to zero
counts as up) and the predictor serves what it was configured to (its champion) and reaches its
registry; else ``degraded``
with ``problems`` naming what failed. ``is_serving`` is the test the launcher and the load tests
wait for: a service whose only problem is a predictor without its champion still serves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

PREDICTOR_UNAVAILABLE = "predictor serves max reservation"  # a problem: it answers, without its champion
REGISTRY_UNREACHABLE = "predictor cannot reach its registry"  # a problem: it answers with the last champion it had
SERVING_PROBLEMS = (PREDICTOR_UNAVAILABLE, REGISTRY_UNREACHABLE)  # the service still answers with these
POOL_KEYS = ("error", "kv_free_tokens", "num_running", "num_waiting", "preemptions", "recomputed_tokens")


async def _ask(call: Awaitable, timeout_s: float = 5.0):
    try:
        return await asyncio.wait_for(call, timeout_s)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return {"error": type(exc).__name__}


async def report(replica_states: Callable[[], dict], pools: Mapping, predictor) -> dict:
    """Ask the pools' and the predictor's handles; the health answer without the ingress's own fields."""
    states = await _ask(asyncio.to_thread(replica_states))
    # NOTE: a pool with no running replica (scaled to zero, or scaling from zero) is not asked: a
    # call would queue at its handle and make Serve start a replica (its cold-start rule), undoing
    # the autoscaler's decision. While deploying (UPDATING) it is asked, so startup waits for it.
    idle = {name for name, s in states.items() if s and s.get("status") != "UPDATING" and not s.get("RUNNING")} \
        if "error" not in states else set()
    answers = {name: {"num_running": 0, "num_waiting": 0} if name in idle else await _ask(handle.stats.remote())
               for name, handle in pools.items()}
    info = await _ask(predictor.info.remote())
    problems = [f"pool {name}: {p['error']}" for name, p in answers.items() if "error" in p]
    if "error" in info:
        problems.append(f"predictor: {info['error']}")
    elif info.get("unavailable"):
        # NOTE: it answers, reserving for max_tokens, but not with the champion: a registry on
        # another node's disk or down, no champion yet, a broken version
        problems.append(f"{PREDICTOR_UNAVAILABLE}: {info['unavailable']}")
    if "error" not in info and info.get("registry_error"):
        problems.append(f"{REGISTRY_UNREACHABLE}: {info['registry_error']}")
    return {
        "status": "degraded" if problems else "ok", "problems": problems, "predictor": info,
        "pools": {name: {k: p[k] for k in POOL_KEYS if k in p} for name, p in answers.items()},
        "replicas": {name: s.get("RUNNING", 0) for name, s in states.items()} if "error" not in states else states,
    }


def is_serving(health: dict | None) -> bool:
    """A ``/health`` answer of a service that serves: ``ok``, or ``degraded`` only because of the
    predictor's registry (max reservation without a champion; the last champion while the registry
    is unreachable)."""
    if not health:
        return False
    problems = health.get("problems") or []
    return health.get("status") == "ok" or (bool(problems) and all(p.startswith(SERVING_PROBLEMS) for p in problems))
