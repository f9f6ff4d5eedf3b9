"""Capacity planner: TP degree and replicas per pool, and the cost per million tokens, for a model,
a GPU type and a traffic mix, from the engine's own simulator (autoscale/planning/capacity.py).

For every TP degree the weights fit at (1, 2, 4, 8) and every KV policy (``reserve_predicted``,
``reserve_max``, ``paged``), one replica's online capacity (highest Poisson rate whose p99 TTFT and
p99 TPOT meet the SLOs) and offline throughput are simulated. The online pool gets
``ceil(rate / (capacity * target_utilization))`` replicas, the offline pool enough to do
``offline_tokens_per_day``; per pool and policy the TP degree needing the fewest GPUs wins (ties:
the smaller TP). foreserve's own choice is ``reserve_predicted``; the others are shown beside it.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor

from pydantic import BaseModel, ConfigDict, Field

from app.engine.sim.profiles import check_tp, kv_budget_bytes_per_rank, parse_sim_spec
from autoscale.planning.capacity import POLICIES, PoolSpec, Workload, online_capacity, simulate_online

# NOTE: assumed on-demand cloud prices (USD per GPU-hour, late 2026); pass --gpu-hour-usd for yours.
GPU_HOUR_USD = {"A100-80G": 1.8, "H100-80G": 2.5, "H200": 3.2}
TP_OPTIONS = (1, 2, 4, 8)
FRONTIER_LOADS = (0.25, 0.5, 0.75, 1.0, 1.25)


class PlanRequest(BaseModel):
    """What ``foreserve plan`` is asked."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("llama-3-8b", description="Model profile (app/engine/profiles.py: MODELS).")
    hardware: str = Field("H100-80G", description="GPU profile (app/engine/profiles.py: HARDWARE).")
    rate_rps: float = Field(10.0, gt=0, description="Online requests per second at peak.")
    ttft_slo_ms: float = Field(1000.0, gt=0, description="Online p99 time to first token.")
    tpot_slo_ms: float = Field(50.0, gt=0, description="Online p99 time per output token.")
    offline_tokens_per_day: float = Field(0.0, ge=0, description="Offline (batch) output tokens per day.")
    max_tokens: int = Field(1024, ge=16, description="max_tokens of the requests (and the predictor's bucket range).")
    target_utilization: float = Field(0.9, gt=0, le=1, description="Share of a replica's SLO capacity the online pool plans for (headroom).")
    gpu_hour_usd: float | None = Field(None, gt=0, description="Price of one GPU-hour; empty: GPU_HOUR_USD's assumption for the hardware.")
    policies: tuple[str, ...] = Field(POLICIES, description="KV policies compared.")
    tp_options: tuple[int, ...] = Field(TP_OPTIONS, description="TP degrees tried (those the weights fit at).")
    duration_s: float = Field(10.0, gt=0, description="Modelled seconds per online simulation.")

    @property
    def price(self) -> float:
        return self.gpu_hour_usd or GPU_HOUR_USD.get(self.hardware, 2.5)


def feasible_tps(req: PlanRequest) -> list[int]:
    hardware, model = parse_sim_spec(f"{req.hardware}:{req.model}")
    out = []
    for tp in req.tp_options:
        try:
            check_tp(model, tp)
            kv_budget_bytes_per_rank(hardware, model, tp)
        except ValueError:
            continue
        out.append(tp)
    if not out:
        raise ValueError(f"{req.model} fits on {req.hardware} at none of the TP degrees {list(req.tp_options)}")
    return out


def _measure(args: tuple) -> dict:
    """One (tp, policy): online capacity and offline throughput of one replica (runs in a worker)."""
    req, tp, policy = args
    hardware, model = parse_sim_spec(f"{req.hardware}:{req.model}")
    spec = PoolSpec(hardware, model, tp, policy)
    workload = Workload.sharegpt(1000, req.max_tokens)
    rps, run, tokens_per_s = online_capacity(spec, workload, req.ttft_slo_ms, req.tpot_slo_ms, req.duration_s)
    return {
        "tensor_parallel_size": tp, "policy": policy, "online_capacity_rps": round(rps, 3),
        "online_ttft_p99_ms": run and round(run.ttft_p99_ms, 1), "online_tpot_p99_ms": run and round(run.tpot_p99_ms, 2),
        "offline_tokens_per_s": round(tokens_per_s, 1), "mean_output_tokens": round(workload.mean_output_tokens, 1),
    }


def _frontier_point(args: tuple) -> dict:
    req, tp, rate = args
    hardware, model = parse_sim_spec(f"{req.hardware}:{req.model}")
    run = simulate_online(PoolSpec(hardware, model, tp), rate, Workload.sharegpt(1000, req.max_tokens), req.duration_s,
                          ttft_slo_ms=req.ttft_slo_ms, tpot_slo_ms=req.tpot_slo_ms)
    return {"tensor_parallel_size": tp, "rate_rps": round(rate, 3),
            "output_tokens_per_s_per_gpu": round(run.output_tokens_per_s / tp, 1),
            "ttft_p99_ms": round(run.ttft_p99_ms, 1), "tpot_p99_ms": round(run.tpot_p99_ms, 2)}


def _map(fn, tasks: list, progress: bool, desc: str) -> list:
    from tqdm import tqdm

    workers = min(len(tasks), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(tqdm(pool.map(fn, tasks), total=len(tasks), desc=desc, disable=not progress, leave=False))


def _pool_choice(rows: list[dict], pool: str, req: PlanRequest) -> dict:
    """Per policy, the TP degree needing the fewest GPUs for ``pool``'s demand."""
    by_policy = {}
    for policy in req.policies:
        options = []
        for row in (r for r in rows if r["policy"] == policy):
            tp = row["tensor_parallel_size"]
            if pool == "online":
                per_replica = row["online_capacity_rps"] * req.target_utilization
                if per_replica <= 0:
                    continue
                replicas = math.ceil(req.rate_rps / per_replica)
                tokens_per_hour = req.rate_rps * row["mean_output_tokens"] * 3600
            else:
                per_replica = row["offline_tokens_per_s"]
                replicas = math.ceil(req.offline_tokens_per_day / (per_replica * 86400)) if req.offline_tokens_per_day else 0
                tokens_per_hour = req.offline_tokens_per_day / 24
            gpus = replicas * tp
            cost = gpus * req.price / tokens_per_hour * 1e6 if tokens_per_hour else 0.0
            options.append({"tensor_parallel_size": tp, "replicas": replicas, "gpus": gpus,
                            "cost_per_million_tokens": round(cost, 4), "per_replica": round(per_replica, 3)})
        if options:
            by_policy[policy] = min(options, key=lambda o: (o["gpus"], o["tensor_parallel_size"]))
    if not by_policy:
        raise ValueError(f"no TP degree of {req.model} on {req.hardware} meets TTFT {req.ttft_slo_ms} ms / "
                         f"TPOT {req.tpot_slo_ms} ms at any rate: relax the SLOs or pick faster hardware")
    chosen_policy = "reserve_predicted" if "reserve_predicted" in by_policy else next(iter(by_policy))
    unit = "rps" if pool == "online" else "tokens_per_s"
    chosen = by_policy[chosen_policy]
    return {"policy": chosen_policy, "tensor_parallel_size": chosen["tensor_parallel_size"], "replicas": chosen["replicas"],
            "gpus": chosen["gpus"], "cost_per_million_tokens": chosen["cost_per_million_tokens"],
            f"per_replica_{unit}": chosen["per_replica"], "by_policy": by_policy}


def plan(req: PlanRequest, progress: bool = True, frontier: bool = True) -> dict:
    """The recommendation (``pools``), every measured candidate and the latency/throughput frontier."""
    tps = feasible_tps(req)
    rows = _map(_measure, [(req, tp, p) for tp in tps for p in req.policies], progress, "simulating replicas")
    report = {
        "inputs": req.model_dump(mode="json") | {"gpu_hour_usd": req.price},
        "pools": {"online": _pool_choice(rows, "online", req), "offline": _pool_choice(rows, "offline", req)},
        "candidates": rows,
    }
    if frontier:
        capacity = {r["tensor_parallel_size"]: r["online_capacity_rps"] for r in rows if r["policy"] == "reserve_predicted"}
        tasks = [(req, tp, capacity[tp] * load) for tp in tps if capacity.get(tp) for load in FRONTIER_LOADS]
        report["frontier"] = _map(_frontier_point, tasks, progress, "latency/throughput frontier") if tasks else []
    return report
