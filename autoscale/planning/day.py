"""A simulated day: diurnal online load plus a steady offline backlog, served two ways.

- ``static_peak``: an online pool sized for the peak minute and an offline pool sized for the
  day's offline tokens, both up all day (what a fleet without elasticity runs).
- ``elastic``: the real ``ElasticPolicy`` (through Ray Serve's own delay/bounds wrapper) decides
  both pools every minute within a budget of the static fleet's replicas: online follows the load,
  offline soaks up what online leaves, and both shrink when not needed (GPU-hours count only
  replicas that are up). With the offline pool at zero its backlog is reported by the ingress's
  gate, as in serving.

One replica's behaviour comes from the engine simulator (autoscale/planning/capacity.py): its SLO capacity
(rate where p99 TTFT/TPOT meet the SLOs), how p99 TTFT grows with load below and above it, and its
offline tokens/s. Each minute is a fluid step: a pool at load ``rho = rate / (replicas * capacity)``
has the simulated p99 TTFT at that load; above capacity a queue builds and drains. New replicas
serve from the minute after they are requested (startup).

Both fleets run several identical days and the last is counted, so neither is credited with (or
charged for) a backlog left by the first. The books compare them on the same work: offline tokens
arrived, done, and the backlog at the counted day's start and end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from unittest import mock

import numpy as np

from autoscale.planning.capacity import PoolSpec, Workload, offline_throughput, online_capacity, simulate_online

LOADS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25)
TICK_S = 60.0
KEPT_UP_SLACK = 0.005  # of the day's offline arrivals: the backlog may end the day this much above its start


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


@dataclass
class Minute:
    """One fleet's minute: what it ran and how it went."""

    rate: float
    online: int
    offline: int
    ttft_ms: float
    load: float       # online rate over the pool's SLO capacity
    queue: float      # online requests waiting past the minute
    backlog: float    # offline tokens arrived and not done, at the minute's end
    done: float       # offline tokens done in the minute


class Fleet:
    """The fluid state of one fleet: online queue and offline backlog, minute by minute."""

    def __init__(self, model: dict, offline_tokens_per_day: float) -> None:
        self.cap, self.off_tps = model["capacity_rps"], model["offline_tokens_per_s"]
        self.ttft_curve = model["ttft_p99_ms"]
        self.arrivals_per_min = offline_tokens_per_day / 1440
        self.queue = self.backlog = 0.0
        self.minutes: list[Minute] = []

    def run_minute(self, online: int, offline: int, rate: float) -> Minute:
        served = online * self.cap * TICK_S
        self.queue = max(0.0, self.queue + rate * TICK_S - served)
        load = rate / (online * self.cap) if online else math.inf
        if online:
            wait_s = self.queue / (online * self.cap)
            ttft = float(np.interp(min(load, LOADS[-1]), LOADS, self.ttft_curve, left=self.ttft_curve[0])) + wait_s * 1000
        else:
            ttft = math.inf
        self.backlog += self.arrivals_per_min
        done = min(self.backlog, offline * self.off_tps * TICK_S)
        self.backlog -= done
        row = Minute(float(rate), online, offline, ttft, load, self.queue, self.backlog, done)
        self.minutes.append(row)
        return row

    def books(self, minutes: int, tp: int, ttft_slo_ms: float) -> dict:
        """The last ``minutes`` (the counted day): GPU-hours, online minutes in SLO, and the offline
        books: tokens arrived, done, the backlog at the day's start and end, the longest wait of a
        token done that day (first in, first out)."""
        rows = self.minutes[-minutes:]
        start = self.minutes[-minutes - 1].backlog if len(self.minutes) > minutes else 0.0
        done = np.cumsum([r.done for r in self.minutes])
        arrived = self.arrivals_per_min * np.arange(1, len(self.minutes) + 1)
        waits = [0.0]
        if self.arrivals_per_min:  # a token done by minute t arrived by the minute cumulative arrivals reached it
            t = np.arange(len(self.minutes) - minutes, len(self.minutes))
            arrived_by = np.interp(done[t], np.concatenate([[0.0], arrived]), np.arange(len(self.minutes) + 1))
            waits = (t + 1 - arrived_by).tolist()
        arrived_day = self.arrivals_per_min * minutes
        return {
            "gpu_hours": round(sum(r.online + r.offline for r in rows) / 60 * tp, 1),
            "online_minutes_within_slo_frac": round(sum(r.ttft_ms <= ttft_slo_ms for r in rows) / minutes, 4),
            "offline_tokens": round(sum(r.done for r in rows)),
            "offline_arrived_tokens": round(self.arrivals_per_min * minutes),
            "offline_backlog_start_tokens": round(start),
            "offline_backlog_end_tokens": round(rows[-1].backlog),
            "offline_max_wait_h": round(max(waits) / 60, 2),
            # a fleet whose backlog grew over the day did not do the day's work
            "kept_up": bool(rows[-1].backlog <= start + KEPT_UP_SLACK * arrived_day),
        }


class ElasticFleet:
    """Decides both pools every minute with the real ``ElasticPolicy``, through Serve's app-level
    delay and bounds wrapper, fed the signals each pool would report."""

    def __init__(self, model: dict, budget: int, online: int, policy_kwargs: dict) -> None:
        from ray.serve._private.common import DeploymentID
        from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
        from ray.serve.config import AutoscalingConfig

        from autoscale.decisions import DecisionLog
        from autoscale.policy import ElasticPolicy

        self.model, self.budget = model, budget
        policy = ElasticPolicy(**policy_kwargs)
        policy.log = DecisionLog(None, quiet=True)  # NOTE: a simulated day writes nothing to the data dir
        self.wrapped = _apply_app_level_autoscaling_config(policy)
        self.ids = {name: DeploymentID(name=name, app_name="sim") for name in ("online", "offline", "ingress")}
        self.cfg = {
            "online": AutoscalingConfig(min_replicas=1, max_replicas=budget, upscale_delay_s=0, downscale_delay_s=600),
            "offline": AutoscalingConfig(min_replicas=0, max_replicas=budget, upscale_delay_s=0, downscale_delay_s=60,
                                         downscale_to_zero_delay_s=60),
            "ingress": AutoscalingConfig(min_replicas=1, max_replicas=1),
        }
        self.targets = {"online": online, "offline": 0, "ingress": 1}
        self.state: dict = {}

    def decide(self, row: Minute, now: float, ttft_slo_ms: float, tpot_slo_ms: float) -> tuple[int, int]:
        """The replicas of each pool for the next minute (a new replica serves from then: startup)."""
        m = self.model
        load = min(row.load, LOADS[-1])
        kv = float(np.interp(load, LOADS, m["kv_util"]))
        running = float(np.interp(load, LOADS, m["running_batch"])) * max(row.load / LOADS[-1], 1.0)
        ttft = min(row.ttft_ms, 1e7)
        metrics = {
            "online": _per_replica(row.online, recent_ttft_ms_p90=ttft, ttft_slo_ms=ttft_slo_ms, recent_tpot_ms_p90=0.0,
                                   tpot_slo_ms=tpot_slo_ms, kv_capacity_tokens=1.0, kv_used_tokens=kv,
                                   num_running=running, num_waiting=0.0),
            "offline": _per_replica(row.offline, kv_capacity_tokens=1.0, kv_used_tokens=0.0,
                                    waiting_predicted_tokens=row.backlog / row.offline if row.offline else 0.0),
            # NOTE: with the offline pool at zero its work waits at the ingress's gate (deployments/pool_gate.py),
            # which reports it: the backlog stays visible to the policy
            "ingress": _per_replica(1, **({"held_requests": math.ceil(row.backlog / m["mean_output_tokens"]),
                                           "held_tokens": row.backlog} if not row.offline and row.backlog else {})),
        }
        replicas = {"online": row.online, "offline": row.offline, "ingress": 1}
        queued = {"online": row.queue / max(row.online, 1), "offline": 0.0, "ingress": 0.0}
        lows = {"online": 1, "offline": 0, "ingress": 1}
        contexts = {
            dep: _context(dep, name, replicas[name], self.targets[name], lows[name], self.budget if name != "ingress" else 1,
                          now, self.state.get(dep, {}), self.cfg[name], metrics[name], queued[name])
            for name, dep in self.ids.items()
        }
        # NOTE: Serve's delay logic reads the wall clock; the simulated day runs on its own
        with mock.patch("ray.serve.autoscaling_policy.time.time", return_value=now):
            decisions, self.state = self.wrapped(contexts)
        self.targets = {name: decisions[dep] for name, dep in self.ids.items()}
        return self.targets["online"], self.targets["offline"]


def simulate_day(model: dict, peak_rps: float, offline_tokens_per_day: float, ttft_slo_ms: float,
                 tpot_slo_ms: float, trough_frac: float = 0.2, policy_kwargs: dict | None = None, days: int = 3) -> dict:
    """Both fleets over ``days`` identical days, the last one counted (the ones before bring the
    offline backlog to its daily cycle); ``model`` from ``replica_model``. Returns each fleet's books
    of the counted day and the elastic fleet's minutes."""
    day = diurnal_rates(peak_rps, trough_frac)
    minutes, tp = len(day), model["tensor_parallel_size"]
    rates = np.tile(day, days)
    static_online = math.ceil(day.max() / model["capacity_rps"])
    static_offline = math.ceil(offline_tokens_per_day / (model["offline_tokens_per_s"] * 86400)) if offline_tokens_per_day else 0

    static = Fleet(model, offline_tokens_per_day)
    for rate in rates:
        static.run_minute(static_online, static_offline, rate)

    budget = static_online + static_offline
    batch_at_capacity = float(np.interp(1.0, LOADS, model["running_batch"]))
    kwargs = {"replica_budget": budget, "calm_s": 300, "decision_log": None, "target_ongoing_requests": batch_at_capacity,
              "offline_backlog_tokens_per_replica": int(model["offline_tokens_per_s"] * 600), **(policy_kwargs or {})}
    controller = ElasticFleet(model, budget, static_online, kwargs)
    elastic = Fleet(model, offline_tokens_per_day)
    online, offline = static_online, 0
    for m, rate in enumerate(rates):
        row = elastic.run_minute(online, offline, rate)
        online, offline = controller.decide(row, (m + 1) * TICK_S, ttft_slo_ms, tpot_slo_ms)

    series = [(i, round(r.rate, 3), r.online, r.offline, round(min(r.ttft_ms, 1e7), 1), round(r.backlog))
              for i, r in enumerate(elastic.minutes[-minutes:])]
    e, s = elastic.books(minutes, tp, ttft_slo_ms), static.books(minutes, tp, ttft_slo_ms)
    return {
        "elastic": {**e, "replica_budget": budget},
        "static_peak": {**s, "online_replicas": static_online, "offline_replicas": static_offline},
        "days": days,
        "same_work": e["kept_up"] and s["kept_up"],
        "gpu_hours_saved_frac": round(1 - e["gpu_hours"] / s["gpu_hours"], 4) if s["gpu_hours"] else 0.0,
        "series": series,
    }
