"""What one replica can do, measured on the engine's simulator (the real scheduler and KV policies
over the roofline step-time model of app/engine/sim/runner.py, Pope et al.).

- ``simulate_online``: open-loop Poisson arrivals at a rate into one replica with the ``online``
  scheduler; p99 TTFT and TPOT, KV use and throughput in modelled time.
- ``online_capacity``: the highest rate whose p99 TTFT and p99 TPOT stay within the SLOs (bisection).
- ``offline_throughput``: output tokens/s of one replica draining a backlog with the ``offline``
  scheduler (all requests queued at once, as a batch job feeds it).

Request lengths come from the ShareGPT validation trace when ``foreserve prepare`` built it, else
from a seeded log-normal mix with the trace's means (111 prompt, 330 output tokens).
``reserve_predicted`` reserves the upper edge of the true length's bucket (a classifier that is
right about the bucket); ``reserve_max`` reserves max_tokens; ``paged`` reserves nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from app.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.sim.profiles import HardwareProfile, ModelProfile
from app.engine.clock import ModelledClock
from app.engine.request import EngineRequest, Prediction, SamplingParams
from app.engine.sim.replay import ReplayRunner
from app.engine.sim.runner import SimRunner
from predictor.buckets import LengthBuckets

POLICIES = ("reserve_predicted", "reserve_max", "paged")
SHAREGPT_MEAN_PROMPT_TOKENS, SHAREGPT_MEAN_OUTPUT_TOKENS = 111, 330


@dataclass(frozen=True)
class Workload:
    """Prompt and true output lengths (tokens) of the requests, cycled as needed."""

    prompt_tokens: list[int]
    output_tokens: list[int]
    max_tokens: int = 1024
    texts: list[str] | None = None  # the user messages (trace workloads), for a real predictor

    @property
    def mean_output_tokens(self) -> float:
        return float(np.mean(self.output_tokens))

    @classmethod
    def sharegpt(cls, n: int = 1000, max_tokens: int = 1024, seed: int = 0) -> "Workload":
        """The validation trace's first ``n`` requests, or a log-normal stand-in without traces."""
        try:
            from app.prepare.traces import load_trace

            records = load_trace("validation")
        except (FileNotFoundError, OSError, RuntimeError):
            records = []
        if records:
            recs = [records[i % len(records)] for i in range(n)]
            return cls([r.prompt_tokens for r in recs], [max(1, min(r.output_tokens, max_tokens)) for r in recs], max_tokens,
                       [r.user for r in recs])
        return cls.lognormal(n, SHAREGPT_MEAN_PROMPT_TOKENS, SHAREGPT_MEAN_OUTPUT_TOKENS, max_tokens, seed)

    @classmethod
    def lognormal(cls, n: int, mean_prompt: float, mean_output: float, max_tokens: int = 1024, seed: int = 0) -> "Workload":
        rng = np.random.default_rng(seed)
        sigma = 0.8  # NOTE: ShareGPT's lengths spread about this much in log space

        def draw(mean: float, cap: int) -> list[int]:
            values = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, n)
            return [int(v) for v in np.clip(values, 1, cap)]

        return cls(draw(mean_prompt, 1024), draw(mean_output, max_tokens), max_tokens)


@dataclass(frozen=True)
class PoolSpec:
    """One replica's shape: hardware, model, TP degree and KV allocation policy."""

    hardware: HardwareProfile
    model: ModelProfile
    tp: int
    policy: str = "reserve_predicted"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class OnlineRun:
    rate_rps: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    kv_util_mean: float
    output_tokens_per_s: float
    mean_running_batch: float


def _engine(spec: PoolSpec, scheduler: str, workload: Workload, ttft_slo_ms: float = 2000, tpot_slo_ms: float = 250):
    runner = SimRunner(spec.hardware, spec.model, spec.tp)
    config = EngineConfig(
        allocation=spec.policy, scheduler=scheduler, default_max_tokens=workload.max_tokens,
        max_model_len_tokens=2048 + workload.max_tokens, max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
        kv_cache_tokens=runner.kv_budget_tokens(),
    )
    num_blocks = config.kv_pool_blocks(runner.kv_bytes_per_token)
    return LLMEngine(config, ReplayRunner(runner), num_blocks, clock=ModelledClock())


def _add(engine: LLMEngine, i: int, workload: Workload, buckets: LengthBuckets, policy: str) -> str:
    n = len(workload.prompt_tokens)
    out = workload.output_tokens[i % n]
    bound = workload.max_tokens if policy == "reserve_max" else buckets.upper_bound_tokens(buckets.bucket_of(out))
    engine.runner.lengths[str(i)] = out  # ends at its recorded length
    req = engine.add_request(EngineRequest(
        prompt_token_ids=[1] * workload.prompt_tokens[i % n],
        sampling=SamplingParams(max_tokens=workload.max_tokens),
        request_id=str(i), prediction=Prediction(bucket=buckets.bucket_of(out), bound_tokens=bound, exact_tokens=out),
        detokenize=False,
    ))
    return req.request_id


def simulate_online(spec: PoolSpec, rate_rps: float, workload: Workload, duration_s: float = 20.0, seed: int = 0,
                    ttft_slo_ms: float = 2000, tpot_slo_ms: float = 250) -> OnlineRun:
    """Poisson arrivals at ``rate_rps`` into one replica for ``duration_s`` of modelled time (at
    least 100 requests). Latencies leave out the first quarter of arrivals (the pool filling up)."""
    engine = _engine(spec, "online", workload, ttft_slo_ms, tpot_slo_ms)
    buckets = LengthBuckets(max_tokens=workload.max_tokens, num_buckets=10)
    requests = max(100, int(rate_rps * duration_s))
    warmup = requests // 4
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate_rps, requests))
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    ttfts, tpots, kv_samples = [], [], []
    i = 0
    while i < requests or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            engine.clock.idle_until(float(arrivals[i]))
        while i < requests and arrivals[i] <= engine.clock():
            arrived[_add(engine, i, workload, buckets, spec.policy)] = float(arrivals[i])
            i += 1
        outputs = engine.step()
        now = engine.clock()
        kv_samples.append(engine.pool.used_tokens / engine.pool.capacity_tokens)
        for out in outputs:
            measured = int(out.request_id) >= warmup
            if out.request_id not in first and out.num_output_tokens:
                first[out.request_id] = now
                if measured:
                    ttfts.append(now - arrived[out.request_id])
            if out.finished and out.num_output_tokens > 1 and measured:
                tpots.append((now - first[out.request_id]) / (out.num_output_tokens - 1))
    stats = engine.stats()
    return OnlineRun(
        rate_rps=rate_rps,
        ttft_p99_ms=float(np.percentile(ttfts, 99)) * 1000,
        tpot_p99_ms=float(np.percentile(tpots, 99)) * 1000 if tpots else 0.0,
        kv_util_mean=float(np.mean(kv_samples)),
        output_tokens_per_s=stats.output_tokens / engine.clock(),
        mean_running_batch=stats.mean_running_batch,
    )


def offline_throughput(spec: PoolSpec, workload: Workload, requests: int = 600) -> float:
    """Output tokens/s of one replica draining ``requests`` queued at once (``offline`` scheduler)."""
    engine = _engine(spec, "offline", workload)
    buckets = LengthBuckets(max_tokens=workload.max_tokens, num_buckets=10)
    for i in range(requests):
        _add(engine, i, workload, buckets, spec.policy)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.stats().output_tokens / engine.clock()


def online_capacity(spec: PoolSpec, workload: Workload, ttft_slo_ms: float, tpot_slo_ms: float,
                    duration_s: float = 10.0, iterations: int = 5) -> tuple[float, OnlineRun | None, float]:
    """(highest rate in req/s within both p99 SLOs, the run at that rate, the offline throughput
    that bounded the search); rate 0 and no run if even a trickle misses them (e.g. a TPOT SLO below
    one decode step)."""
    def ok(run: OnlineRun) -> bool:
        return run.ttft_p99_ms <= ttft_slo_ms and run.tpot_p99_ms <= tpot_slo_ms

    tokens_per_s = offline_throughput(spec, workload)
    ceiling = tokens_per_s / workload.mean_output_tokens  # no online schedule beats the offline packing
    kwargs = {"duration_s": duration_s, "ttft_slo_ms": ttft_slo_ms, "tpot_slo_ms": tpot_slo_ms}
    probe = simulate_online(spec, ceiling * 0.05, workload, **kwargs)
    if not ok(probe):
        return 0.0, None, tokens_per_s
    low, best, high = ceiling * 0.05, probe, ceiling
    for _ in range(iterations):
        mid = (low + high) / 2
        run = simulate_online(spec, mid, workload, **kwargs)
        if ok(run):
            low, best = mid, run
        else:
            high = mid
    return low, best, tokens_per_s
