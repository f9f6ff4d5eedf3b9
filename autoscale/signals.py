"""What a pool's replicas tell the autoscaler, summed up as one ``PoolSignals``.

Each engine replica's ``record_autoscaling_stats`` (deployments/engine_server.py) reports its KV
pool (``kv_capacity_tokens``, ``kv_used_tokens``: physical blocks, reservations included), its
queue (``waiting_predicted_tokens``: prompt + predicted output of what waits; ``oldest_pending_ms``:
the wait of the oldest request still without its first token)
and its recent latencies against its own SLOs (``recent_ttft_ms_p90`` / ``ttft_slo_ms``, same for
TPOT). Serve averages each over ``look_back_period_s`` per replica; this module reduces them over
the pool. Nothing here counts in-flight requests alone: an LLM replica with 60 short chats can be
idle while one with 4 long ones is full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool at one autoscaling tick. Ratios are 0 when nothing was reported yet."""

    replicas: int  # running now
    target_replicas: int  # what Serve is scaling to
    min_replicas: int
    max_replicas: int
    ttft_slo_ratio: float  # worst replica's p90 TTFT / its TTFT SLO
    tpot_slo_ratio: float
    pending_slo_ratio: float  # wait of the oldest request without a first token / TTFT SLO: pressure as it builds
    kv_demand_ratio: float  # (KV held + waiting predicted tokens) / KV capacity, over the pool
    backlog_tokens: float  # KV held + waiting predicted tokens: the work the pool has in hand
    ongoing_per_replica: float  # running + waiting sequences per replica
    queued_requests: float  # waiting at callers' handles for a free replica (max_ongoing_requests reached)

    @property
    def slo_ratio(self) -> float:
        return max(self.ttft_slo_ratio, self.tpot_slo_ratio, self.pending_slo_ratio)

    def summary(self) -> dict[str, float]:
        """The numbers a decision was made on, rounded for the decision log."""
        keys = ("replicas", "ttft_slo_ratio", "tpot_slo_ratio", "pending_slo_ratio", "kv_demand_ratio",
                "backlog_tokens", "ongoing_per_replica", "queued_requests")
        return {k: round(float(getattr(self, k)), 3) for k in keys}


@dataclass(frozen=True, slots=True)
class HeldCalls:
    """Offline calls the ingress holds while the offline pool is at zero (deployments/pool_gate.py)."""

    requests: float = 0.0
    tokens: float = 0.0  # their prompt + predicted output


def held_calls(ctx) -> HeldCalls:
    """``HeldCalls`` from the ingress deployment's ``AutoscalingContext`` (summed over its replicas)."""
    metrics = ctx.aggregated_metrics or {}
    return HeldCalls(requests=sum(_per_replica(metrics, "held_requests").values()),
                     tokens=sum(_per_replica(metrics, "held_tokens").values()))


def _per_replica(metrics: dict[str, dict[Any, float]], name: str) -> dict[Any, float]:
    return metrics.get(name) or {}


def _ratio(metrics: dict[str, dict[Any, float]], value: str, slo: str) -> float:
    values, slos = _per_replica(metrics, value), _per_replica(metrics, slo)
    ratios = [v / slos[r] for r, v in values.items() if slos.get(r)]
    return max(ratios, default=0.0)


def pool_signals(ctx) -> PoolSignals:
    """Reduce a Serve ``AutoscalingContext`` (or anything with its attributes) to ``PoolSignals``."""
    metrics = ctx.aggregated_metrics or {}
    capacity = sum(_per_replica(metrics, "kv_capacity_tokens").values())
    held = sum(_per_replica(metrics, "kv_used_tokens").values())
    waiting = sum(_per_replica(metrics, "waiting_predicted_tokens").values())
    queued = ctx.total_queued_requests or 0.0
    ongoing = sum(_per_replica(metrics, "num_running").values()) + sum(_per_replica(metrics, "num_waiting").values())
    reporting = len(_per_replica(metrics, "kv_capacity_tokens"))
    return PoolSignals(
        replicas=ctx.current_num_replicas,
        target_replicas=ctx.target_num_replicas,
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        ttft_slo_ratio=_ratio(metrics, "recent_ttft_ms_p90", "ttft_slo_ms"),
        tpot_slo_ratio=_ratio(metrics, "recent_tpot_ms_p90", "tpot_slo_ms"),
        pending_slo_ratio=_ratio(metrics, "oldest_pending_ms", "ttft_slo_ms"),
        kv_demand_ratio=(held + waiting) / capacity if capacity else 0.0,
        backlog_tokens=held + waiting,
        ongoing_per_replica=ongoing / reporting if reporting else 0.0,
        queued_requests=float(queued),
    )
