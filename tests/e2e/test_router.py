"""The KV-aware request router: the reservation it reads, the headroom it ranks by, ties and
missing stats falling back to Serve's default, what it routed debiting stale stats, and Serve's own
routing loop (probes, ranks, backoff) driving it, on fake replicas and then on real Serve replicas."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.router import KVAwareRouter, headroom_tokens, rank_by_headroom, reservation_tokens

pytestmark = pytest.mark.ray  # Serve's router classes; the slow test starts Serve

DEPLOYMENT = DeploymentID(name="online", app_name="test")


def _request(num_prompt_tokens=None, bound=None, max_tokens=None) -> dict:
    request = {"messages": [], "sampling": {} if max_tokens is None else {"max_tokens": max_tokens}}
    if num_prompt_tokens is not None:
        request["num_prompt_tokens"] = num_prompt_tokens
    request["prediction"] = None if bound is None else {"bucket": 2, "probabilities": [0.1, 0.9], "bound_tokens": bound}
    return request


def _pending(*args, method: str = "generate") -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id=uuid.uuid4().hex, call_method=method)
    return PendingRequest(args=list(args), kwargs={}, metadata=meta)


@dataclass(eq=False)
class FakeReplica:
    """What Serve's routing loop reads of a ``RunningReplica``."""

    name: str
    routing_stats: dict = field(default_factory=dict)
    queue_len: int = 0
    max_ongoing_requests: int = 8
    node_id: str | None = None
    availability_zone: str | None = None
    is_cross_language: bool = False
    multiplexed_model_ids: set = field(default_factory=set)

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=DEPLOYMENT)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _kv(free: int, waiting: int = 0, reported_at_s: float | None = None) -> dict:
    stats = {"kv_capacity_tokens": 16384, "kv_free_tokens": free, "kv_used_tokens": 16384 - free,
             "num_running": 0, "num_waiting": 0, "waiting_predicted_tokens": waiting}
    return stats if reported_at_s is None else {**stats, "reported_at_s": reported_at_s}


def _router(*replicas: FakeReplica) -> KVAwareRouter:
    router = KVAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.update_replicas(list(replicas))  # type: ignore[arg-type]
    return router


def _names(ranks) -> list[list[str]]:
    return [[r.name for r in rank] for rank in ranks]


def test_reservation_is_prompt_plus_bound_or_max_tokens_and_never_raises():
    assert reservation_tokens([_request(100, 307, 1024)]) == 407
    assert reservation_tokens([_request(100, None, 1024)]) == 1124  # no prediction: max_tokens
    assert reservation_tokens([_request(100, 2**31 - 1, 2000)]) == 2100  # a max fallback's bound: max_tokens
    assert reservation_tokens([{"num_prompt_tokens": 5, "prediction": {"bucket": 1, "bound_tokens": None}, "sampling": {"max_tokens": 9}}]) == 14
    assert reservation_tokens([_request()]) == 0
    for odd in (None, [], "abc", ["not a dict"], [{"prediction": [1], "sampling": "x", "num_prompt_tokens": "abc"}],
                [{"prediction": "abc", "sampling": {"max_tokens": None}}], ({"num_prompt_tokens": -5},),
                [{"num_prompt_tokens": float("inf"), "prediction": {"bound_tokens": float("nan")}}]):
        assert reservation_tokens(odd) == 0, odd


def test_headroom_subtracts_waiting_promises_debits_and_the_request():
    stats = _kv(4000, waiting=1000)
    assert headroom_tokens(stats, 500) == 2500
    assert headroom_tokens(stats, 500, debit_tokens=300) == 2200
    assert headroom_tokens({"kv_free_tokens": 100}, 50) == 50  # waiting promises missing: 0
    for unreported in ({}, None, {"num_running": 1}, {"kv_free_tokens": None}, "stats"):
        assert headroom_tokens(unreported, 10) is None


def test_rank_by_headroom_best_first_ties_share_a_rank_many_ties_sample_two():
    assert rank_by_headroom([(1, "a"), (9, "b"), (5, "c")]) == [["b"], ["c", "a"]]
    assert [sorted(rank) for rank in rank_by_headroom([(5, "a"), (5, "b")])] == [["a", "b"]]
    assert rank_by_headroom([]) == []
    ranks = rank_by_headroom([(7, "a"), (7, "b"), (7, "c"), (7, "d"), (1, "e")])
    assert len(ranks[0]) == 2 and sorted(ranks[0] + ranks[1][:2]) == ["a", "b", "c", "d"] and ranks[1][-1] == "e"


async def test_most_headroom_ranks_first_and_serve_routes_there():
    a = FakeReplica("a", _kv(2000))
    b = FakeReplica("b", _kv(8000, waiting=5000))
    c = FakeReplica("c", _kv(6000))
    router = _router(a, b, c)
    assert _names(await router.choose_replicas([a, b, c], _pending(_request(100, 200)))) == [["c"], ["b", "a"]]
    chosen = await router._choose_replica_for_request(_pending(_request(100, 200)))  # Serve's probe/rank loop
    assert chosen is c
    c.queue_len = c.max_ongoing_requests  # the best one is full: the fallback rank takes it
    a.queue_len = 2  # NOTE: within a rank Serve picks the shorter queue; equal queues would be a coin flip
    chosen = await router._choose_replica_for_request(_pending(_request(100, 200)))
    assert chosen is b


async def test_ties_form_one_rank_that_serve_breaks_by_queue_length():
    a, b = FakeReplica("a", _kv(4096), queue_len=3), FakeReplica("b", _kv(4096), queue_len=1)
    router = _router(a, b)
    ranks = await router.choose_replicas([a, b], _pending(_request(10, 100)))
    assert len(ranks) == 1 and {r.name for r in ranks[0]} == {"a", "b"}
    assert await router._choose_replica_for_request(_pending(_request(10, 100))) is b


async def test_routed_requests_debit_a_replica_until_its_next_report():
    reported = time.time() - 1
    a, b = FakeReplica("a", _kv(5000, reported_at_s=reported)), FakeReplica("b", _kv(4000, reported_at_s=reported))
    router = _router(a, b)
    big = _pending(_request(500, 1500))
    assert (await router.choose_replicas([a, b], big))[0] == [a]
    router.on_request_routed(big, a.replica_id, None)  # a owes 2000 more since its report
    assert (await router.choose_replicas([a, b], _pending(_request(500, 1500))))[0] == [b]
    a.routing_stats = {**a.routing_stats, "reported_at_s": time.time() + 1}  # a fresh report covers it
    assert (await router.choose_replicas([a, b], _pending(_request(500, 1500))))[0] == [a]
    assert router._routed[a.replica_id] == []
    router.on_request_routed(big, b.replica_id, None)
    router.on_request_routed(_pending(method="stats"), a.replica_id, None)  # only generate calls count
    router.update_replicas([a])  # type: ignore[list-item]  # b left: its debits go too
    assert b.replica_id not in router._routed and router._routed[a.replica_id] == []


async def test_no_report_time_means_no_debit():
    a, b = FakeReplica("a", _kv(5000)), FakeReplica("b", _kv(4000))
    router = _router(a, b)
    for _ in range(3):
        router.on_request_routed(_pending(_request(500, 1500)), a.replica_id, None)
    assert (await router.choose_replicas([a, b], _pending(_request(500, 1500))))[0] == [a]


async def test_missing_stats_other_methods_and_odd_args_do_not_break_routing():
    a, b, c = FakeReplica("a", _kv(100)), FakeReplica("b"), FakeReplica("c", _kv(9000))  # b: not reported yet
    router = _router(a, b, c)
    for pending in (_pending(_request(1, None, 8)), _pending(method="stats"), _pending(method="generate")):
        ranks = await router.choose_replicas([a, b, c], pending)  # Serve's power of two choices
        assert len(ranks) == 1 and len(ranks[0]) == 2 and set(ranks[0]) <= {a, b, c}
    assert await router._choose_replica_for_request(_pending(method="stats")) in (a, b, c)
    b.routing_stats = _kv(50)
    for args in ([], ["not a dict"], [{"prediction": "?"}], [None, 1]):
        assert _names(await router.choose_replicas([a, b, c], _pending(*args))) == [["c"], ["a", "b"]]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_real_serve_routes_by_kv_headroom(tmp_path, monkeypatch):
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    flag = str(tmp_path / "flip")  # once it exists, the replicas swap their free KV

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(
                          request_router_class="deployments.router:KVAwareRouter", request_routing_stats_period_s=0.1))
    class Pool:
        def __init__(self) -> None:
            import os

            rank = serve.get_replica_context().rank
            self.rank, self.exists = int(getattr(rank, "rank", rank)), os.path.exists
            self.flipped, self.since = False, time.time()

        def generate(self, request: dict) -> int:
            return self.rank

        def record_routing_stats(self) -> dict:
            if not self.flipped and self.exists(flag):
                self.flipped, self.since = True, time.time()
            free = 10000 if (self.rank == 0) != self.flipped else 5000
            # NOTE: the dummy never books what it serves, so its report is as of its last change
            return {"kv_capacity_tokens": 16384, "kv_free_tokens": free, "kv_used_tokens": 16384 - free,
                    "num_running": 0, "num_waiting": 0, "waiting_predicted_tokens": 0, "reported_at_s": self.since}

    def route(request: dict) -> int:
        return handle.generate.remote(request).result(timeout_s=30)

    def settle(rank: int) -> None:  # zero-reservation probes until 10 in a row reach `rank` (the deadline: a hang)
        deadline, streak = time.time() + 300, 0
        while streak < 10:
            assert time.time() < deadline, "routing stats never reached the router"
            streak = streak + 1 if route(_request(0, 0)) == rank else 0

    # the handle's router runs in this process: its debits must not expire however slow the machine
    monkeypatch.setattr("deployments.router.DEBIT_TTL_S", 1e9)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(Pool.bind(), name="router-test", route_prefix=None)
        settle(0)
        assert [route(_request(30, 20)) for _ in range(20)] == [0] * 20  # all to the replica with more free KV
        open(flag, "w").close()
        settle(1)
        # 2000-token reservations, free 10000 vs 5000: rank 1 until its debits leave less than rank 0.
        # A broadcast in between changes nothing: each report is as of its replica's flip, so every
        # debit since stays (and none expires: DEBIT_TTL_S above)
        got = [route(_request(500, 1500)) for _ in range(5)]
        assert got == [1, 1, 1, 0, 1], got
        # no prediction: max_tokens is the reservation
        assert [route(_request(500, None, 1500)) for _ in range(2)] == [0, 1]
    finally:
        serve.shutdown()
        ray.shutdown()
