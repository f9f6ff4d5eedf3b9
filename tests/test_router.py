"""The KV-aware request router: the reservation it reads, the headroom it ranks by, ties and
missing stats falling back to Serve's default, and what it routed debiting stale stats."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from deployments.router import KVAwareRouter, headroom_tokens, reservation_tokens


def _call(num_prompt_tokens=None, prediction=None, max_tokens=None, method="generate"):
    request = {"messages": [], "sampling": {} if max_tokens is None else {"max_tokens": max_tokens}}
    if num_prompt_tokens is not None:
        request["num_prompt_tokens"] = num_prompt_tokens
    request["prediction"] = prediction
    meta = type("Meta", (), {"call_method": method})()
    return type("Pending", (), {"args": [request], "kwargs": {}, "metadata": meta})()


@dataclass
class FakeReplica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)


def _router() -> KVAwareRouter:
    router = object.__new__(KVAwareRouter)  # the ranking needs none of Serve's routing state
    router._routed = {}
    return router


def test_reservation_reads_prompt_plus_prediction_or_max_tokens():
    assert reservation_tokens(_call(100, [2, None, 307], 1024).args) == 407
    assert reservation_tokens(_call(100, None, 1024).args) == 1124  # no prediction: max_tokens
    assert reservation_tokens(_call().args) == 0
    assert reservation_tokens(["not a dict"]) == 0 and reservation_tokens([]) == 0 and reservation_tokens(None) == 0


def test_headroom_subtracts_waiting_promises_debits_and_the_request():
    stats = {"kv_free_tokens": 4000, "waiting_predicted_tokens": 1000}
    assert headroom_tokens(stats, 500) == 2500
    assert headroom_tokens(stats, 500, debit_tokens=300) == 2200
    assert headroom_tokens({}, 10) is None and headroom_tokens(None, 10) is None


def test_most_headroom_first_then_the_rest():
    a = FakeReplica("a", {"kv_free_tokens": 2000, "waiting_predicted_tokens": 0, "reported_at_s": time.time()})
    b = FakeReplica("b", {"kv_free_tokens": 8000, "waiting_predicted_tokens": 5000, "reported_at_s": time.time()})
    c = FakeReplica("c", {"kv_free_tokens": 6000, "waiting_predicted_tokens": 0, "reported_at_s": time.time()})
    ranks = asyncio.run(_router().choose_replicas([a, b, c], _call(100, [1, None, 200])))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["c"], ["b", "a"]]


def test_ties_form_one_rank_for_serve_to_break():
    stats = {"kv_free_tokens": 4096, "waiting_predicted_tokens": 0, "reported_at_s": time.time()}
    a, b = FakeReplica("a", dict(stats)), FakeReplica("b", dict(stats))
    ranks = asyncio.run(_router().choose_replicas([a, b], _call(10, [0, None, 100])))
    assert len(ranks) == 1 and {r.replica_id for r in ranks[0]} == {"a", "b"}


def test_routed_requests_debit_a_replica_until_its_next_report():
    router = _router()
    reported = time.time() - 1
    a = FakeReplica("a", {"kv_free_tokens": 5000, "waiting_predicted_tokens": 0, "reported_at_s": reported})
    b = FakeReplica("b", {"kv_free_tokens": 4000, "waiting_predicted_tokens": 0, "reported_at_s": reported})
    first = asyncio.run(router.choose_replicas([a, b], _call(500, [3, None, 1500])))
    assert first[0][0].replica_id == "a"
    router.on_request_routed(_call(500, [3, None, 1500]), "a", None)  # a owes 2000 more since its report
    second = asyncio.run(router.choose_replicas([a, b], _call(500, [3, None, 1500])))
    assert second[0][0].replica_id == "b"
    a.routing_stats = {**a.routing_stats, "reported_at_s": time.time() + 1}  # a fresh report covers it
    third = asyncio.run(router.choose_replicas([a, b], _call(500, [3, None, 1500])))
    assert third[0][0].replica_id == "a" and router._routed["a"] == []


def test_missing_stats_or_other_methods_use_the_default_router(monkeypatch: pytest.MonkeyPatch):
    calls = []

    async def default(self, candidates, pending=None):
        calls.append(pending.metadata.call_method)
        return [candidates]

    monkeypatch.setattr("ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter.choose_replicas", default)
    a = FakeReplica("a", {"kv_free_tokens": 100})
    b = FakeReplica("b")  # not reported yet
    assert asyncio.run(_router().choose_replicas([a, b], _call(1, None, 8))) == [[a, b]]
    assert asyncio.run(_router().choose_replicas([a], _call(method="stats"))) == [[a]]
    assert calls == ["generate", "stats"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_real_serve_routes_to_the_replica_with_most_free_kv():
    import os

    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(
                          request_router_class="deployments.router:KVAwareRouter", request_routing_stats_period_s=0.2))
    class Pool:
        def __init__(self) -> None:
            self.free = os.getpid() * 1000  # distinct per replica process

        def generate(self, request: dict) -> int:
            return self.free

        def free_kv(self) -> int:  # not `generate`: routed by Serve's default, so both replicas answer
            return self.free

        def record_routing_stats(self) -> dict:
            return {"kv_free_tokens": self.free, "waiting_predicted_tokens": 0, "reported_at_s": time.time()}

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        handle = serve.run(Pool.bind(), name="router-test", route_prefix=None)
        time.sleep(2)  # both replicas have reported
        request = {"num_prompt_tokens": 10, "prediction": [0, None, 10]}
        chosen = [handle.generate.remote(request).result() for _ in range(20)]
        assert len(set(chosen)) == 1, chosen  # always the replica with more free KV...
        frees = {handle.free_kv.remote().result() for _ in range(60)}
        assert len(frees) == 2 and chosen[0] == max(frees)  # ...which is the one with more
    finally:
        serve.shutdown()
        ray.shutdown()
