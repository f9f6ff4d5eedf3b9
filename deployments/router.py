"""KV-aware request routing for the engine pools (a Ray Serve ``RequestRouter``).

The default router balances queue lengths, which says little about an LLM replica: one long
answer can hold more KV than ten short ones. Each engine replica publishes its free KV and the
tokens promised to its waiting requests (``record_routing_stats``); each request carries its
prompt length and predicted output bound. A request goes to the replica with the most KV left
after its reservation. Stats arrive every ``request_routing_stats_period_s``, so the router also
debits what it routed since a replica's last report, lest a burst all land on one replica.
Without stats for every candidate, or on a tie, Serve's power-of-two choices decides.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica


def reservation_tokens(args: Any) -> int:
    """Prompt + predicted output tokens (max_tokens without a prediction) of a ``generate`` call."""
    request = args[0] if isinstance(args, (list, tuple)) and args else None
    if not isinstance(request, dict):
        return 0
    prompt = request.get("num_prompt_tokens") or 0
    prediction = request.get("prediction")
    if prediction:
        output = prediction[2]
    else:
        output = (request.get("sampling") or {}).get("max_tokens") or 0
    return int(prompt) + int(output)


def headroom_tokens(stats: dict | None, need_tokens: int, debit_tokens: int = 0) -> int | None:
    """KV tokens a replica has left after what it owes its waiting requests, what was routed to it
    since its last report, and this request; None when it has not reported yet."""
    if not stats or "kv_free_tokens" not in stats:
        return None
    owed = stats.get("waiting_predicted_tokens", 0) + debit_tokens
    return int(stats["kv_free_tokens"]) - int(owed) - need_tokens


class KVAwareRouter(PowerOfTwoChoicesRequestRouter):
    """Most KV headroom first; the remaining replicas as a lower rank, so a full queue on the best
    one still routes. Serve probes queue lengths within a rank, which breaks ties."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._routed: dict[ReplicaID, list[tuple[float, int]]] = {}

    def _debit(self, replica: RunningReplica) -> int:
        reported_s = (replica.routing_stats or {}).get("reported_at_s", 0.0)
        recent = [(t, n) for t, n in self._routed.get(replica.replica_id, []) if t > reported_s]
        self._routed[replica.replica_id] = recent
        return sum(n for _, n in recent)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return await super().choose_replicas(candidate_replicas, pending_request)
        need = reservation_tokens(pending_request.args)
        scored = [(headroom_tokens(r.routing_stats, need, self._debit(r)), r) for r in candidate_replicas]
        if not scored or any(h is None for h, _ in scored):
            return await super().choose_replicas(candidate_replicas, pending_request)
        scored.sort(key=lambda hr: hr[0], reverse=True)
        best = scored[0][0]
        top = [r for h, r in scored if h == best]
        rest = [r for h, r in scored if h != best]
        return [top, rest] if rest else [top]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if pending_request.metadata.call_method == "generate":
            self._routed.setdefault(replica_id, []).append((time.time(), reservation_tokens(pending_request.args)))
