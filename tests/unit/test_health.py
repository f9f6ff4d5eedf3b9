"""``/health``'s judgement from the answers of the pools and the predictor (handles faked)."""

from __future__ import annotations

import asyncio

from deployments.health import is_serving, report
from tests.fake_handles import Handle


STATES = {"online": {"RUNNING": 1}, "offline": {"RUNNING": 1}}
POOLS = {"online": Handle(stats={"num_running": 0, "num_waiting": 0}), "offline": Handle(stats={"num_running": 0, "num_waiting": 0})}


def _health(info) -> dict:
    return asyncio.run(report(lambda: STATES, POOLS, Handle(info=info)))


def test_ok_when_everything_answers_and_the_champion_serves():
    health = _health({"version": "3", "unavailable": None, "registry_error": None})
    assert health["status"] == "ok" and health["problems"] == [] and is_serving(health)


def test_an_unreachable_registry_is_degraded_but_still_serving():
    health = _health({"version": "3", "unavailable": None, "registry_error": "ConnectionError: refused"})
    assert health["status"] == "degraded"
    assert health["problems"] == ["predictor cannot reach its registry: ConnectionError: refused"]
    assert is_serving(health)


def test_max_fallback_is_degraded_but_still_serving_and_a_dead_pool_is_not():
    health = _health({"version": "max-fallback", "unavailable": "no champion in sqlite:///x"})
    assert health["status"] == "degraded" and is_serving(health)
    dead = asyncio.run(report(lambda: STATES, {**POOLS, "online": Handle(stats=RuntimeError("gone"))},
                              Handle(info={"version": "3"})))
    assert dead["problems"] == ["pool online: RuntimeError"] and not is_serving(dead)
