"""The cost model against this machine: measured decode steps of the real model (SmolLM2-135M,
float32, the engine's HFRunner) vs the simulator's roofline step time on a CPU profile whose two
constants (effective memory bandwidth and FLOP/s) are fitted to the measurements.

The simulator's step time is ``max(memory_s, compute_s) + overhead_s`` with
``memory_s = bytes / bandwidth`` and ``compute_s = flops / flop_rate``; the bytes and FLOPs of each
measured step come from SimRunner itself (with unit constants), so the fit checks the very formula
that plans GPU fleets. The fit minimises the worst relative error over the batch sizes.
"""

from __future__ import annotations

import numpy as np

from app.engine.profiles import MODELS, HardwareProfile

CPU_OVERHEAD_S = 2e-3  # per step on CPU: sampling, Python, a torch dispatch per layer and sequence


def cpu_profile(bandwidth_bytes_per_s: float, flops: float, name: str = "CPU") -> HardwareProfile:
    """A CPU as the roofline sees it: the two constants are achieved rates (efficiencies 1)."""
    return HardwareProfile(
        name=name, hbm_bytes=24 << 30, hbm_bandwidth_bytes_per_s=bandwidth_bytes_per_s, peak_flops=flops,
        interconnect_bandwidth_bytes_per_s=1e10, interconnect_latency_s=2e-5, usable_memory_fraction=0.5,
        memory_efficiency=1.0, mfu=1.0, overhead_s=CPU_OVERHEAD_S,
    )


def _components(batch: int, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of ``batch`` sequences at ``context`` cached tokens (fp32)."""
    from app.engine.request import SamplingParams, ScheduledChunk
    from app.engine.sim import SimRunner

    model = MODELS["smollm2-135m"].model_copy(update={"bytes_per_param": 4})
    runner = SimRunner(cpu_profile(1.0, 1.0), model)
    greedy = SamplingParams(temperature=0.0)
    chunks = [ScheduledChunk(f"r{i}", [1], context, [], True, greedy, 0) for i in range(batch)]
    cost = runner.step_cost(chunks)
    return cost.memory_s, cost.compute_s  # with unit rates: bytes and FLOPs


def fit(points: list[tuple[int, float]], context: int) -> tuple[float, float, float]:
    """(bandwidth, flop rate, worst relative error) for measured (batch, seconds) points."""
    comps = np.array([_components(b, context) for b, _ in points])
    measured = np.array([t for _, t in points])
    bws = np.logspace(8.5, 11.5, 301)
    fls = np.logspace(9, 12.5, 351)
    mem = comps[:, 0][None, None, :] / bws[:, None, None]
    cmp = comps[:, 1][None, None, :] / fls[None, :, None]
    predicted = np.maximum(mem, cmp) + CPU_OVERHEAD_S
    worst = np.abs(predicted / measured - 1).max(axis=2)
    i, j = np.unravel_index(worst.argmin(), worst.shape)
    return float(bws[i]), float(fls[j]), float(worst[i, j])


def measure(batch_sizes: list[int], context: int, repeats: int) -> list[tuple[int, float]]:
    """Median decode step time (s) of the real model at each batch size."""
    from transformers import AutoConfig

    from app.config import EngineConfig
    from app.engine.runner import HFRunner
    from loadtests.runner_microbench import bench_runner

    steps = repeats
    tokens = max(batch_sizes) * (context + 2 * steps + 40)
    config = EngineConfig(kv_cache_tokens=tokens, max_model_len_tokens=max(2048, context + 64))
    hf = AutoConfig.from_pretrained(config.model_path)
    runner = HFRunner(config, config.kv_pool_blocks(HFRunner.kv_bytes_per_token(hf, config.dtype)))
    return [(b, bench_runner(runner, b, context, steps, warmup=2) / 1000) for b in batch_sizes]


def calibrate(batch_sizes: list[int], context: int = 256, repeats: int = 3) -> dict:
    points = measure(batch_sizes, context, repeats)
    bandwidth, flops, worst = fit(points, context)
    rows = []
    for b, t in points:
        mem, cmp = _components(b, context)
        predicted = max(mem / bandwidth, cmp / flops) + CPU_OVERHEAD_S
        rows.append({"batch_size": b, "measured_ms": round(t * 1000, 2), "predicted_ms": round(predicted * 1000, 2),
                     "error": round(predicted / t - 1, 4), "bound": "memory" if mem / bandwidth >= cmp / flops else "compute"})
    return {
        "context_tokens": context,
        "fitted": {"memory_bandwidth_bytes_per_s": round(bandwidth), "flops": round(flops), "overhead_s": CPU_OVERHEAD_S},
        "points": rows,
        "max_abs_error": round(worst, 4),
    }
