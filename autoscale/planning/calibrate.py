"""The cost model against this machine: measured decode steps of the real model (SmolLM2-135M,
float32, the engine's HFRunner) vs the simulator's roofline step time on a CPU profile whose two
constants (effective memory bandwidth and FLOP/s) are fitted to the measurements.

The simulator's step time is ``max(memory_s, compute_s) + overhead_s`` with
``memory_s = bytes / bandwidth`` and ``compute_s = flops / flop_rate``; the bytes and FLOPs of each
measured step come from SimRunner itself (with unit constants), so the fit checks the very formula
that plans GPU fleets. The fit minimises the worst relative error over the batch sizes.

``calibrate_trace`` fits the same two constants to the steps a serving engine actually ran
(``FORESERVE_STEP_TRACE``): mixed prefill and decode, real contexts, and whatever else shares the
cores. It minimises the median relative error (single traced steps are noisy).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from app.engine.sim.profiles import MODELS, HardwareProfile
from app.engine.step_trace import read_steps

CPU_OVERHEAD_S = 2e-3  # per step on CPU: sampling, Python, a torch dispatch per layer and sequence


def cpu_profile(bandwidth_bytes_per_s: float, flops: float, name: str = "CPU") -> HardwareProfile:
    """A CPU as the roofline sees it: the two constants are achieved rates (efficiencies 1)."""
    return HardwareProfile(
        name=name, hbm_bytes=24 << 30, hbm_bandwidth_bytes_per_s=bandwidth_bytes_per_s, peak_flops=flops,
        interconnect_bandwidth_bytes_per_s=1e10, interconnect_latency_s=2e-5, usable_memory_fraction=0.5,
        memory_efficiency=1.0, mfu=1.0, overhead_s=CPU_OVERHEAD_S,
    )


def cpu_model():
    """SmolLM2-135M as the engine runs it on CPU (float32 weights and KV)."""
    return MODELS["smollm2-135m"].model_copy(update={"bytes_per_param": 4})


@lru_cache(maxsize=1)
def _unit_runner():
    """SimRunner on a CPU of unit rates: its memory_s and compute_s are bytes and FLOPs."""
    from app.engine.sim.runner import SimRunner

    return SimRunner(cpu_profile(1.0, 1.0), cpu_model())


def _step_components(chunks: list[tuple[int, int, bool]]) -> tuple[float, float]:
    """(bytes, FLOPs) of one step of (cached tokens, new tokens, sampled) chunks, as SimRunner costs it."""
    from app.engine.outputs import ScheduledChunk
    from app.engine.request import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    step = [ScheduledChunk(f"r{i}", [1] * n, start, [], bool(sample), greedy, 0)
            for i, (start, n, sample) in enumerate(chunks)]
    cost = _unit_runner().step_cost(step)
    return cost.memory_s, cost.compute_s


def _components(batch: int, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of ``batch`` sequences at ``context`` cached tokens (fp32)."""
    return _step_components([(context, 1, True)] * batch)


def _step_s(comps: np.ndarray, bandwidth, flops):
    """The roofline step time of (bytes, FLOPs) rows; broadcasts over arrays of rates."""
    return np.maximum(comps[..., 0] / bandwidth, comps[..., 1] / flops) + CPU_OVERHEAD_S


def _fit(comps: np.ndarray, measured: np.ndarray, reduce) -> tuple[float, float, float]:
    """Grid search of (bandwidth, flop rate) minimising ``reduce`` of the relative errors."""
    bws = np.logspace(8.5, 11.5, 301)
    fls = np.logspace(9, 12.5, 351)
    predicted = _step_s(comps[None, None], bws[:, None, None], fls[None, :, None])
    loss = reduce(np.abs(predicted / measured - 1), axis=2)
    i, j = np.unravel_index(loss.argmin(), loss.shape)
    return float(bws[i]), float(fls[j]), float(loss[i, j])


def fit(points: list[tuple[int, float]], context: int) -> tuple[float, float, float]:
    """(bandwidth, flop rate, worst relative error) for measured (batch, seconds) points."""
    comps = np.array([_components(b, context) for b, _ in points])
    return _fit(comps, np.array([t for _, t in points]), np.max)


def measure(batch_sizes: list[int], context: int, repeats: int) -> list[tuple[int, float]]:
    """Median decode step time (s) of the real model at each batch size."""
    from app.config import EngineConfig
    from app.engine.model.arch import arch_config
    from app.engine.model.hf_runner import HFRunner
    from app.engine.model.timing import bench_runner

    steps = repeats
    tokens = max(batch_sizes) * (context + 2 * steps + 40)
    config = EngineConfig(kv_cache_tokens=tokens, max_model_len_tokens=max(2048, context + 64))
    hf = arch_config(config.model_path)[1]
    runner = HFRunner(config, config.kv_pool_blocks(HFRunner.kv_bytes_per_token(hf, config.cache_dtype)))
    return [(b, bench_runner(runner, b, context, steps, warmup=2) / 1000) for b in batch_sizes]


def calibrate(batch_sizes: list[int], context: int = 256, repeats: int = 3) -> dict:
    points = measure(batch_sizes, context, repeats)
    bandwidth, flops, worst = fit(points, context)
    rows = []
    for b, t in points:
        mem, cmp = _components(b, context)
        predicted = float(_step_s(np.array([mem, cmp]), bandwidth, flops))
        rows.append({"batch_size": b, "measured_ms": round(t * 1000, 2), "predicted_ms": round(predicted * 1000, 2),
                     "error": round(predicted / t - 1, 4), "bound": "memory" if mem / bandwidth >= cmp / flops else "compute"})
    return {
        "context_tokens": context,
        "fitted": {"memory_bandwidth_bytes_per_s": round(bandwidth), "flops": round(flops), "overhead_s": CPU_OVERHEAD_S},
        "points": rows,
        "max_abs_error": round(worst, 4),
    }


def calibrate_trace(paths: list[Path], max_steps: int = 4000) -> dict:
    """Fit the CPU profile to traced engine steps (``FORESERVE_STEP_TRACE`` JSONL files).

    Reports the median error over all steps and, per decode batch size, the median measured and
    modelled step time of the pure decode steps."""
    steps = [rec for rec in read_steps(paths) if rec.get("chunks") and rec["forward_s"] > 0]
    if not steps:
        raise ValueError(f"no traced steps with chunks in {', '.join(map(str, paths))}")
    steps = steps[:: max(1, len(steps) // max_steps)]
    comps = np.array([_step_components([tuple(c) for c in rec["chunks"]]) for rec in steps])
    measured = np.array([rec["forward_s"] for rec in steps])
    bandwidth, flops, median_error = _fit(comps, measured, np.median)
    predicted = _step_s(comps, bandwidth, flops)
    rows = []
    for lo, hi in ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 1 << 30)):
        idx = [i for i, rec in enumerate(steps) if rec["prefill_tokens"] == 0 and lo <= rec["decode_rows"] <= hi]
        if idx:
            m, p = float(np.median(measured[idx])), float(np.median(predicted[idx]))
            rows.append({"decode_rows": f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+", "steps": len(idx),
                         "measured_ms": round(m * 1000, 2), "predicted_ms": round(p * 1000, 2), "error": round(p / m - 1, 4)})
    return {
        "source": "trace",
        "steps": len(steps),
        "fitted": {"memory_bandwidth_bytes_per_s": round(bandwidth), "flops": round(flops), "overhead_s": CPU_OVERHEAD_S},
        "median_abs_error": round(median_error, 4),
        "decode_steps": rows,
    }
