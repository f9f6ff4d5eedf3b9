"""foreserve's autoscaling: per-pool targets and the elastic split of one replica budget.

Built on Ray Serve's custom autoscaling API. ``ElasticPolicy`` is the application-level policy
(serve_config.yaml: ``autoscaling_policy``): each tick Serve hands it every autoscaled deployment's
``AutoscalingContext`` and applies what it returns through the deployment's own ``upscale_delay_s``
/ ``downscale_delay_s`` (the cooldowns), scaling factors and min/max bounds. ``OnlinePolicy`` and
``OfflinePolicy`` are the same rules as deployment-level policies, for a pool deployed alone.

- Online grows on SLO pressure: p90 TTFT or TPOT of recent requests, or the wait of the oldest
  request still without its first token, above ``scale_up_slo_ratio`` of the SLO; on occupancy
  above ``scale_up_occupancy`` (KV demand: held blocks, reservations included, plus the waiting
  requests' prompt + predicted output; or sequences per replica over ``target_ongoing_requests``);
  or on requests queueing at the handles. It shrinks one replica at a time, only when every signal
  is calm and the replicas left would stay below ``calm_occupancy``: the gap is the hysteresis.
- Offline sizes to its backlog of predicted tokens (growing at one replica per
  ``offline_backlog_tokens_per_replica``, shrinking once the backlog would half-fill one replica
  less), and keeps ``offline_idle_replicas`` warm.
- Elasticity: online comes first. While online is under pressure the offline pool gives up one
  replica per tick down to its min_replicas (which may be 0); it grows back only after online has
  been calm for ``calm_s``, and never beyond the budget online leaves; until then it asks for no
  more than it last asked for, so a pause in the pressure does not cancel a yield that is waiting out
  Serve's downscale delay. Serve drains removed replicas
  (``graceful_shutdown_timeout_s``); what does not finish in time is retried by the caller.
- No starvation: offline work left without a replica for ``offline_max_yield_s`` (online pressured
  all that time) gets one replica back, its share, though online stays pressured; online leaves it
  room, and the pool keeps it until its backlog is done.
- A pool at zero is not woken by Serve's cold-start rule behind the policy's back: the ingress holds
  flex calls while offline is at zero (deployments/pool_gate.py) and reports them; they count as
  offline backlog, so offline comes back on the policy's terms (online calm), and they go then.
"""

from __future__ import annotations

import math
import time

from pydantic import BaseModel, ConfigDict, Field

from autoscale.decisions import Decision, DecisionLog, default_log_path
from autoscale.signals import HeldCalls, PoolSignals, held_calls, pool_signals

LAST_PRESSURE_KEY = "foreserve_last_pressure_s"
STARVED_SINCE_KEY = "foreserve_offline_starved_since_s"  # offline had work and no replica since then
SHARE_KEY = "foreserve_offline_share"  # offline holds its one-replica share until its backlog is done
OFFLINE_WISH_KEY = "foreserve_offline_desired"  # what the policy last asked for offline, before Serve's delays


class ScalingConfig(BaseModel):
    """Thresholds of the policies (``policy_kwargs`` in serve_config.yaml). Ratios are unitless."""

    model_config = ConfigDict(extra="forbid")

    scale_up_slo_ratio: float = Field(0.8, gt=0, description="Online grows when p90 TTFT, p90 TPOT or the wait of the oldest request without a first token passes this share of the pool's SLO.")
    calm_slo_ratio: float = Field(0.4, ge=0, description="Online counts as calm below this share of its SLOs (and with occupancy calm too): it may shrink, offline may grow back.")
    scale_up_occupancy: float = Field(0.9, gt=0, description="Online grows when its occupancy passes this: KV held (reservations included) plus waiting predicted tokens over KV capacity, or running + waiting sequences per replica over target_ongoing_requests, whichever is higher.")
    calm_occupancy: float = Field(0.75, ge=0, description="Online may shrink (and counts as calm) when its occupancy with one replica less would stay below this.")
    target_ongoing_requests: float | None = Field(None, gt=0, description="Sequences per online replica at its SLO capacity (foreserve plan reports it); empty: occupancy is KV demand alone.")
    offline_backlog_tokens_per_replica: int = Field(32768, gt=0, description="Offline wants one replica per this many tokens of backlog (KV held + waiting prompt and predicted output tokens).")
    offline_idle_replicas: int = Field(1, ge=0, description="Offline replicas kept while online is calm even without backlog (warm for flex work); 0 lets the pool idle at its min_replicas.")
    calm_s: float = Field(20.0, ge=0, description="Online must have been calm this long before the offline pool grows back.")
    offline_max_yield_s: float | None = Field(120.0, gt=0, description="Offline work waits at most this long without a replica while online is under pressure; then the pool gets one replica back and keeps it until its backlog is done. Empty: offline yields for as long as online is pressured.")
    replica_budget: int | None = Field(None, ge=1, description="Engine replicas the cluster holds, online + offline (e.g. GPUs / tensor_parallel_size); empty: the pools' max_replicas summed, i.e. no sharing.")
    online_deployment: str = Field("online", description="Name of the online pool's deployment.")
    offline_deployment: str = Field("offline", description="Name of the offline pool's deployment.")
    ingress_deployment: str = Field("ingress", description="Name of the ingress deployment, whose held flex calls (offline pool at zero) count as offline backlog; it must be autoscaled (fixed bounds) to report them.")
    decision_log: str | None = Field(None, description="JSONL file of decisions; empty: $FORESERVE_HOME/autoscale/decisions.jsonl.")

    def model_post_init(self, _context) -> None:
        if self.calm_slo_ratio >= self.scale_up_slo_ratio or self.calm_occupancy >= self.scale_up_occupancy:
            raise ValueError("calm_* thresholds must be below their scale_up_* counterparts (that gap is the hysteresis)")


def online_decision(sig: PoolSignals, cfg: ScalingConfig) -> tuple[Decision, bool]:
    """(decision, under_pressure) for the online pool, before the budget and bounds."""
    n = max(sig.replicas, 1)
    signals = sig.summary()
    if sig.replicas == 0:
        # NOTE: not pressure: Serve starts the first replica itself, and at startup every pool is at 0
        desired = 1 if sig.queued_requests else 0
        return Decision("online", 0, desired, "cold_start" if desired else "idle", signals=signals), False
    occupancy = sig.kv_demand_ratio
    if cfg.target_ongoing_requests:
        occupancy = max(occupancy, sig.ongoing_per_replica / cfg.target_ongoing_requests)
    slo_load = sig.slo_ratio / cfg.scale_up_slo_ratio
    kv_load = occupancy / cfg.scale_up_occupancy
    # NOTE: queued_requests is averaged over look_back_period_s: >= 1 means requests kept queueing at
    # the handles (every replica at max_ongoing_requests), not one that waited for a replica to start.
    # Replicas with no request in their engines are not full: that queue is a startup's (calls wait
    # until the handles learn of the new replicas), and taking offline's replica would not help it.
    queued = sig.queued_requests >= 1 and sig.ongoing_per_replica > 0
    if queued or slo_load > 1 or kv_load > 1:
        reason = "queued" if queued and max(slo_load, kv_load) <= 1 else (
            "slo" if slo_load >= kv_load else "occupancy")
        desired = max(n + 1, math.ceil(n * max(slo_load, kv_load)))
        detail = f"SLO at {sig.slo_ratio:.0%}, occupancy {occupancy:.0%}, {sig.queued_requests:.0f} queued"
        return Decision("online", sig.replicas, desired, reason, detail, signals), True
    # NOTE: shrink only if the replicas left would still be calm: occupancy after losing one replica
    # (n / (n - 1) of today's) below calm_occupancy, itself below scale_up_occupancy: no flapping
    if sig.slo_ratio < cfg.calm_slo_ratio and occupancy * n / max(n - 1, 1) < cfg.calm_occupancy:
        needed = math.ceil(n * occupancy / cfg.scale_up_occupancy)
        desired = max(n - 1, needed, 1)
        return Decision("online", sig.replicas, desired, "calm", "all signals below calm levels", signals), False
    return Decision("online", sig.replicas, sig.replicas, "hold", "between calm and scale-up levels", signals), False


def offline_decision(sig: PoolSignals, cfg: ScalingConfig, idle_replicas: int = 0, held: HeldCalls | None = None) -> Decision:
    """The offline pool's own wish: one replica per ``offline_backlog_tokens_per_replica`` of backlog
    (``held``: calls the ingress holds while the pool is at zero count too)."""
    per_replica = cfg.offline_backlog_tokens_per_replica
    held = held or HeldCalls()
    backlog = sig.backlog_tokens + held.tokens
    desired = math.ceil(backlog / per_replica)
    if desired < sig.target_replicas:  # hysteresis: shrink only once the backlog would half-fill fewer replicas
        desired = min(sig.target_replicas, max(desired, math.ceil(2 * backlog / per_replica)))
    if sig.queued_requests > 0:
        desired = max(desired, sig.replicas + 1 if sig.replicas else 1)
    if held.requests > 0:
        desired = max(desired, 1)
    reason = "backlog" if desired >= idle_replicas else "idle"
    desired = max(desired, idle_replicas)
    detail = f"{backlog:.0f} backlog tokens, {sig.queued_requests:.0f} queued, {held.requests:.0f} held at the ingress"
    return Decision("offline", sig.replicas, desired, reason, detail, sig.summary())


def offline_has_work(sig: PoolSignals, held: HeldCalls | None) -> bool:
    """Offline has work in hand: tokens in its replicas, calls queued at its handle or held at the ingress."""
    return sig.backlog_tokens > 0 or sig.queued_requests > 0 or bool(held and held.requests > 0)


def _clamp(value: int, sig: PoolSignals) -> int:
    return max(sig.min_replicas, min(sig.max_replicas, value))


def _bounded(decision: Decision, sig: PoolSignals) -> Decision:
    desired = _clamp(decision.desired, sig)
    if desired == decision.desired:
        return decision
    bound = "max_replicas" if desired < decision.desired else "min_replicas"
    return Decision(decision.pool, decision.current, desired, decision.reason,
                    f"{decision.detail}; held at {bound}", decision.signals)


class ElasticPolicy:
    """Application-level policy: ``(contexts by DeploymentID) -> (replicas, policy state) by id``."""

    def __init__(self, **kwargs) -> None:
        self.config = ScalingConfig(**kwargs)
        self.log = DecisionLog(self.config.decision_log or default_log_path())

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        cfg = self.config
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        state = {dep_id: dict(ctx.policy_state or {}) for dep_id, ctx in contexts.items()}
        decisions: dict = {}
        online, offline = by_name.get(cfg.online_deployment), by_name.get(cfg.offline_deployment)
        ingress = by_name.get(cfg.ingress_deployment)
        now = next((c.current_time for c in contexts.values() if c.current_time is not None), None)
        now = time.time() if now is None else now

        on_sig = pool_signals(online[1]) if online else None
        off_sig = pool_signals(offline[1]) if offline else None
        budget = cfg.replica_budget or sum(s.max_replicas for s in (on_sig, off_sig) if s)
        off_floor = off_sig.min_replicas if off_sig else 0
        held = held_calls(ingress[1]) if ingress else None
        share = self._share(state[offline[0]], off_sig, held, now) if offline else False

        pressured = False
        online_target = 0
        if online:
            dep_id, _ = online
            decision, pressured = online_decision(on_sig, cfg)
            decision = _bounded(decision, on_sig)
            # NOTE: online grows into what offline has given back (replicas still up hold their GPUs);
            # offline yields meanwhile, so the budget holds at every instant
            off_in_use = max(off_floor, off_sig.replicas, 1 if share else 0) if off_sig else 0
            if decision.desired > budget - off_in_use:
                decision = Decision("online", decision.current, max(on_sig.min_replicas, budget - off_in_use),
                                    decision.reason, f"{decision.detail}; offline holds {off_in_use} of the {budget} replicas",
                                    decision.signals)
            # what online will hold: its wish, or more while Serve's downscale delay keeps replicas up
            online_target = max(decision.desired, on_sig.replicas, on_sig.target_replicas)
            if pressured or decision.reason == "hold":
                state[dep_id][LAST_PRESSURE_KEY] = now
            decisions[dep_id] = decision.desired
            self.log.record(decision, now)

        if offline:
            dep_id, _ = offline
            last_pressure = state[online[0]].get(LAST_PRESSURE_KEY) if online else None
            calm_for_s = math.inf if last_pressure is None else now - last_pressure
            room = budget - online_target
            own = offline_decision(off_sig, cfg, cfg.offline_idle_replicas, held)
            if pressured:
                desired = max(off_floor, min(off_sig.target_replicas - 1, own.desired))
                decision = Decision("offline", off_sig.replicas, desired, "yield", "online is under pressure", own.signals)
            elif calm_for_s >= cfg.calm_s:
                decision = own
            else:  # may shrink to what its backlog needs, may not grow until online is calm
                # NOTE: not above its last wish either: a yield waiting out Serve's downscale delay
                # leaves the target unchanged, and asking for that target again would cancel it
                cap = min(off_sig.target_replicas, state[dep_id].get(OFFLINE_WISH_KEY, off_sig.target_replicas))
                decision = Decision("offline", off_sig.replicas, min(cap, own.desired), "wait_calm",
                                    f"online calm for {calm_for_s:.0f}/{cfg.calm_s:.0f} s; {own.detail}", own.signals)
            if share and decision.desired < 1:
                decision = Decision("offline", off_sig.replicas, 1, "share",
                                    f"online is under pressure, but offline work waited {cfg.offline_max_yield_s:.0f} s "
                                    f"without a replica: one until its backlog is done; {own.detail}", own.signals)
            if decision.desired > room:
                decision = Decision("offline", decision.current, max(off_floor, room), decision.reason,
                                    f"{decision.detail}; online holds {online_target} of {budget} replicas",
                                    decision.signals)
            decision = _bounded(decision, off_sig)
            decisions[dep_id] = state[dep_id][OFFLINE_WISH_KEY] = decision.desired
            self.log.record(decision, now)

        for name, (dep_id, ctx) in by_name.items():  # other autoscaled deployments: left as they are
            if dep_id not in decisions:
                decisions[dep_id] = ctx.target_num_replicas
        return decisions, state

    def _share(self, off_state: dict, sig: PoolSignals, held: HeldCalls | None, now: float) -> bool:
        """Whether offline is owed its one-replica share: its work has had no replica for
        ``offline_max_yield_s``; owed until that work is done (kept in the pool's policy state)."""
        limit = self.config.offline_max_yield_s
        if limit is None or not offline_has_work(sig, held):
            off_state.pop(STARVED_SINCE_KEY, None)
            off_state.pop(SHARE_KEY, None)
            return False
        if off_state.get(SHARE_KEY):
            return True
        if sig.replicas > 0:  # a replica still works on it
            off_state.pop(STARVED_SINCE_KEY, None)
            return False
        since = off_state.setdefault(STARVED_SINCE_KEY, now)
        if now - since < limit:
            return False
        off_state[SHARE_KEY] = True
        return True


class _PoolPolicy:
    """A deployment-level policy (a pool deployed without the app-level one): ``(ctx) -> (replicas, state)``."""

    def __init__(self, **kwargs) -> None:
        self.config = ScalingConfig(**kwargs)
        self.log = DecisionLog(self.config.decision_log or default_log_path())

    def decide(self, sig: PoolSignals) -> Decision:
        raise NotImplementedError

    def __call__(self, ctx) -> tuple[int, dict]:
        sig = pool_signals(ctx)
        decision = _bounded(self.decide(sig), sig)
        self.log.record(decision, ctx.current_time)
        return decision.desired, dict(ctx.policy_state or {})


class OnlinePolicy(_PoolPolicy):
    """The online rules alone."""

    def decide(self, sig: PoolSignals) -> Decision:
        return online_decision(sig, self.config)[0]


class OfflinePolicy(_PoolPolicy):
    """The offline rules alone (no online pool to yield to)."""

    def decide(self, sig: PoolSignals) -> Decision:
        return offline_decision(sig, self.config, self.config.offline_idle_replicas)
