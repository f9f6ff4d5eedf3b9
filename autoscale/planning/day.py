"""A simulated day: diurnal online load plus a steady offline backlog, served two ways.

- ``static_peak``: an online pool sized for the peak minute and an offline pool sized for the
  day's offline tokens, both up all day (what a fleet without elasticity runs).
- ``elastic``: the real ``ElasticPolicy`` (through Ray Serve's own delay/bounds wrapper) decides
  both pools every minute within a budget of the static fleet's online replicas: online follows the
  load, offline soaks up what online leaves, and both shrink when not needed (GPU-hours count only
  replicas that are up).

One replica's behaviour comes from the engine simulator (autoscale/planning/capacity.py): its SLO capacity
(rate where p99 TTFT/TPOT meet the SLOs), how p99 TTFT grows with load below and above it, and its
offline tokens/s. Each minute is a fluid step: a pool at load ``rho = rate / (replicas * capacity)``
has the simulated p99 TTFT at that load; above capacity a queue builds and drains. New replicas
serve from the minute after they are requested (startup).
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np

from autoscale.planning.capacity import PoolSpec, Workload, offline_throughput, online_capacity, simulate_online

LOADS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25)
TICK_S = 60.0


def diurnal_rates(peak_rps: float, trough_frac: float = 0.2, minutes: int = 1440, peak_minute: int = 14 * 60) -> np.ndarray:
    """Per-minute online rate: a cosine day between ``trough_frac * peak`` and ``peak`` (peak mid-afternoon)."""
    t = np.arange(minutes)
    shape = 0.5 * (1 + np.cos(2 * np.pi * (t - peak_minute) / minutes))
    return peak_rps * (trough_frac + (1 - trough_frac) * shape)


def replica_model(spec: PoolSpec, workload: Workload, ttft_slo_ms: float, tpot_slo_ms: float, duration_s: float = 15.0) -> dict:
    """One replica, simulated: SLO capacity, p99 TTFT and KV use by load, offline tokens/s."""
    capacity, _, _ = online_capacity(spec, workload, ttft_slo_ms, tpot_slo_ms, duration_s)
    if capacity <= 0:
        raise ValueError(f"{spec.model.name} tp={spec.tp} on {spec.hardware.name} cannot meet the SLOs at any rate")
    curve = [simulate_online(spec, capacity * rho, workload, duration_s, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
             for rho in LOADS]
    return {
        "capacity_rps": capacity,
        "ttft_p99_ms": [r.ttft_p99_ms for r in curve],
        "kv_util": [r.kv_util_mean for r in curve],
        "running_batch": [r.mean_running_batch for r in curve],
        "tensor_parallel_size": spec.tp,
        "offline_tokens_per_s": offline_throughput(spec, workload),
        "mean_output_tokens": workload.mean_output_tokens,
    }


def _context(dep, name: str, replicas: int, target: int, lo: int, hi: int, now: float, state: dict, config, metrics: dict, queued: float):
    from ray.serve.config import AutoscalingContext

    return AutoscalingContext(
        deployment_id=dep, deployment_name=name, app_name=dep.app_name, current_num_replicas=replicas,
        target_num_replicas=target, running_replicas=[], total_num_requests=queued, total_queued_requests=queued,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=state, last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config,
    )


def _per_replica(n: int, **values: float) -> dict:
    return {k: {f"r{i}": float(v) for i in range(n)} for k, v in values.items()}


def simulate_day(model: dict, peak_rps: float, offline_tokens_per_day: float, ttft_slo_ms: float,
                 tpot_slo_ms: float, trough_frac: float = 0.2, policy_kwargs: dict | None = None) -> dict:
    """Both fleets over one day; ``model`` from ``replica_model``. Returns per-fleet totals and series."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    from autoscale.decisions import DecisionLog
    from autoscale.policy import ElasticPolicy

    cap, ttft_curve, kv_curve = model["capacity_rps"], model["ttft_p99_ms"], model["kv_util"]
    batch_curve, tp = model["running_batch"], model["tensor_parallel_size"]
    off_tps = model["offline_tokens_per_s"]
    day = diurnal_rates(peak_rps, trough_frac)
    minutes = len(day)
    rates = np.concatenate([day, day])  # NOTE: day 1 warms up (offline backlog carried over); day 2 counts
    static_online = math.ceil(rates.max() / cap)
    static_offline = math.ceil(offline_tokens_per_day / (off_tps * 86400)) if offline_tokens_per_day else 0
    arrivals_per_min = offline_tokens_per_day / minutes

    def ttft_at(rho: float, queue_s: float) -> float:
        return float(np.interp(rho, LOADS, ttft_curve, left=ttft_curve[0])) + queue_s * 1000

    def minute(online: int, rate: float, queue: float) -> tuple[float, float, float]:
        """(p99 TTFT ms, requests still queued, load) after one minute of ``rate`` on ``online`` replicas."""
        served = online * cap * TICK_S
        queue = max(0.0, queue + rate * TICK_S - served)
        rho = rate / (online * cap) if online else math.inf
        wait_s = queue / (online * cap) if online else math.inf
        return (ttft_at(min(rho, LOADS[-1]), wait_s) if online else math.inf), queue, rho

    def drain(backlog: float, replicas: int) -> tuple[float, float]:
        """(backlog left, tokens done) after a minute of offline arrivals and ``replicas`` working."""
        backlog += arrivals_per_min
        done = min(backlog, replicas * off_tps * TICK_S)
        return backlog - done, done

    # -- static: both pools up all day ---------------------------------------------------------
    queue = backlog = 0.0
    static_ok = static_tokens = 0.0
    for m, rate in enumerate(rates):
        ttft, queue, _ = minute(static_online, rate, queue)
        backlog, done = drain(backlog, static_offline)
        if m >= minutes:
            static_ok += ttft <= ttft_slo_ms
            static_tokens += done

    # -- elastic: the real policy every minute --------------------------------------------------
    budget = static_online + static_offline
    batch_at_capacity = float(np.interp(1.0, LOADS, batch_curve))
    kwargs = {"replica_budget": budget, "calm_s": 300, "decision_log": None, "target_ongoing_requests": batch_at_capacity,
              "offline_backlog_tokens_per_replica": int(off_tps * 600), **(policy_kwargs or {})}
    policy = ElasticPolicy(**kwargs)
    policy.log = DecisionLog(None, quiet=True)  # NOTE: a simulated day writes nothing to the data dir
    wrapped = _apply_app_level_autoscaling_config(policy)
    on_id, off_id = DeploymentID(name="online", app_name="sim"), DeploymentID(name="offline", app_name="sim")
    on_cfg = AutoscalingConfig(min_replicas=1, max_replicas=budget, upscale_delay_s=0, downscale_delay_s=600)
    off_cfg = AutoscalingConfig(min_replicas=0, max_replicas=budget, upscale_delay_s=0, downscale_delay_s=60,
                                downscale_to_zero_delay_s=60)
    online, offline = static_online, 0
    on_target, off_target = online, offline
    state: dict = {}
    queue = backlog = 0.0
    ok = tokens = replica_minutes = 0.0
    series = []
    for m, rate in enumerate(rates):
        ttft, queue, rho = minute(online, rate, queue)
        backlog, done = drain(backlog, offline)
        if m >= minutes:
            ok += ttft <= ttft_slo_ms
            tokens += done
            replica_minutes += online + offline
            series.append((m - minutes, round(float(rate), 3), online, offline, round(min(ttft, 1e7), 1)))
        load = min(rho, LOADS[-1])
        kv = float(np.interp(load, LOADS, kv_curve))
        running = float(np.interp(load, LOADS, batch_curve)) * max(rho / LOADS[-1], 1.0)
        on_metrics = _per_replica(online, recent_ttft_ms_p90=min(ttft, 1e7), ttft_slo_ms=ttft_slo_ms,
                                  recent_tpot_ms_p90=0.0, tpot_slo_ms=tpot_slo_ms, kv_capacity_tokens=1.0,
                                  kv_used_tokens=kv, num_running=running, num_waiting=0.0)
        off_metrics = _per_replica(offline, kv_capacity_tokens=1.0, kv_used_tokens=0.0,
                                   waiting_predicted_tokens=backlog / offline if offline else 0.0)
        now = (m + 1) * TICK_S
        contexts = {
            on_id: _context(on_id, "online", online, on_target, 1, budget, now, state.get(on_id, {}), on_cfg, on_metrics,
                            queue / max(online, 1)),
            # NOTE: the offline backlog waits outside Serve's handles (in a batch job's driver, or held at
            # the ingress: deployments/pool_gate.py), where Serve's cold-start rule would restart a yielded pool
            off_id: _context(off_id, "offline", offline, off_target, 0, budget, now, state.get(off_id, {}), off_cfg,
                             off_metrics, 0.0),
        }
        # NOTE: Serve's delay logic reads the wall clock; the simulated day runs on its own
        with mock.patch("ray.serve.autoscaling_policy.time.time", return_value=now):
            decisions, state = wrapped(contexts)
        on_target, off_target = decisions[on_id], decisions[off_id]
        online, offline = on_target, off_target  # NOTE: up from the next minute (replica startup)

    hours = minutes / 60
    return {
        "elastic": {"gpu_hours": round(replica_minutes / 60 * tp, 1), "online_minutes_within_slo_frac": round(float(ok) / minutes, 4),
                    "offline_tokens": round(float(tokens)), "replica_budget": budget},
        "static_peak": {"gpu_hours": round((static_online + static_offline) * hours * tp, 1),
                        "online_minutes_within_slo_frac": round(float(static_ok) / minutes, 4), "offline_tokens": round(float(static_tokens)),
                        "online_replicas": static_online, "offline_replicas": static_offline},
        "series": series,
    }
