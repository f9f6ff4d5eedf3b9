"""KV-aware request routing for the engine pools (a Ray Serve ``RequestRouter``).

Why: Serve's default router balances queue lengths, which says little about an LLM replica: one
long answer holds more KV than ten short ones, and the predictor tells us, before routing, how
long each answer will roughly be. So each engine replica publishes its free KV and the tokens
promised to its waiting requests (``record_routing_stats``), each ``generate`` call carries its
prompt length and predicted output bound, and the call goes to the replica with the most KV left
after its reservation. Stats arrive only every ``request_routing_stats_period_s``, so the router
also debits what it routed to a replica since that replica's last report (``reported_at_s``),
lest a burst all land on one replica. Replicas without stats yet and other methods go to Serve's
power of two choices; replicas tied for the best headroom go to Serve's queue-length probe.

Attach with ``RequestRouterConfig(request_router_class="deployments.router:KVAwareRouter",
request_routing_stats_period_s=...)`` as a deployment's ``request_router_config``.
"""

from __future__ import annotations

import random
import time
from typing import Any, TypeVar

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

ROUTED_METHOD = "generate"
DEBIT_TTL_S = 30.0  # NOTE: bounds the debit if a replica's reports stall or its clock runs behind
T = TypeVar("T")


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def reservation_tokens(args: Any) -> int:
    """Prompt + predicted output bound (``max_tokens`` without a prediction) of a ``generate``
    call's request dict ``args[0]``; 0 for anything missing or malformed."""
    request = args[0] if isinstance(args, (list, tuple)) and args else None
    if not isinstance(request, dict):
        return 0
    prediction, sampling = request.get("prediction"), request.get("sampling")
    max_tokens = _int(sampling.get("max_tokens")) if isinstance(sampling, dict) else 0
    if isinstance(prediction, dict) and prediction.get("bound_tokens") is not None:
        output = _int(prediction["bound_tokens"])
        output = min(output, max_tokens) if max_tokens > 0 else output  # NOTE: the engine clamps so too
    else:
        output = max_tokens
    return max(0, _int(request.get("num_prompt_tokens"))) + max(0, output)


def headroom_tokens(stats: Any, need_tokens: int, debit_tokens: int = 0) -> int | None:
    """KV tokens a replica keeps after what it owes its waiting requests, what this router sent it
    since its last report and this request (``need_tokens``); None when it has not reported."""
    if not isinstance(stats, dict) or not isinstance(stats.get("kv_free_tokens"), (int, float)):
        return None
    owed = _int(stats.get("waiting_predicted_tokens")) + debit_tokens
    return _int(stats["kv_free_tokens"]) - owed - need_tokens


def rank_by_headroom(scored: list[tuple[int, T]]) -> list[list[T]]:
    """Ranks for ``choose_replicas``: the best headroom first, the rest (most headroom first) as a
    fallback rank Serve tries when the first rank's queues are full. Tied for the best: two at
    random lead, as in power of two choices (Serve probes them; the shorter queue, else the first, wins)."""
    ordered = sorted(scored, key=lambda hr: hr[0], reverse=True)
    if not ordered:
        return []
    tied = [r for h, r in ordered if h == ordered[0][0]]
    top = random.sample(tied, min(2, len(tied)))  # NOTE: shuffled, or equal queues always pick the first
    rest = [r for r in tied if r not in top] + [r for h, r in ordered if h != ordered[0][0]]
    return [top, rest] if rest else [top]


def _call_method(pending_request: PendingRequest | None) -> str | None:
    return getattr(getattr(pending_request, "metadata", None), "call_method", None)


class KVAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Most KV headroom first. NOTE: no ``FIFOMixin``: the replica chosen for a request must serve
    that request (exact match), not whichever request is oldest, since the choice depends on its size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._routed: dict[ReplicaID, list[tuple[float, int]]] = {}

    async def _default(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        # NOTE: delegate to Serve's own policy; it needs only the mixins' state, which we have.
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)  # type: ignore[arg-type]

    def _debit(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats
        reported_s = stats.get("reported_at_s") if isinstance(stats, dict) else None
        if not isinstance(reported_s, (int, float)):  # no report time: nothing to reconcile against
            self._routed.pop(replica.replica_id, None)
            return 0
        floor_s = max(float(reported_s), time.time() - DEBIT_TTL_S)
        recent = [(t, n) for t, n in self._routed.get(replica.replica_id, ()) if t > floor_s]
        self._routed[replica.replica_id] = recent
        return sum(n for _, n in recent)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or _call_method(pending_request) != ROUTED_METHOD:
            return await self._default(candidate_replicas, pending_request)
        need = reservation_tokens(pending_request.args)
        scored = [(headroom_tokens(r.routing_stats, need, self._debit(r)), r) for r in candidate_replicas]
        if not scored or any(h is None for h, _ in scored):
            return await self._default(candidate_replicas, pending_request)
        # NOTE: without this Serve retries a full first choice at once, forever, without backoff.
        pending_request.routing_context.should_backoff = True
        return rank_by_headroom(scored)  # type: ignore[arg-type]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if _call_method(pending_request) == ROUTED_METHOD:
            self._routed.setdefault(replica_id, []).append((time.time(), reservation_tokens(pending_request.args)))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._routed = {rid: v for rid, v in self._routed.items() if rid in self._replica_id_set}
