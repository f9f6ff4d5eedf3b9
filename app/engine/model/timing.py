"""Step timings of a runner on synthetic sequences: what the CPU calibration (``autoscale.planning.
calibrate``) fits its profile to and what ``loadtests/bench/runner_microbench.py`` prints.

The KV blocks are allocated but hold whatever the pool holds: a step's time does not depend on it."""

from __future__ import annotations

import statistics

from app.engine.kv.pool import KVPool
from app.engine.outputs import ScheduledChunk, SchedulerOutput
from app.engine.request import SamplingParams


def bench_runner(runner, batch: int, context: int, steps: int, warmup: int,
                 sampling: SamplingParams = SamplingParams(temperature=0.0)) -> float:
    """Median milliseconds of a decode step of ``batch`` sequences at ``context`` cached tokens."""
    pool = KVPool(runner.num_blocks, runner.block_size)
    tables = [pool.allocate(pool.blocks_for(context + warmup + steps + 1)) for _ in range(batch)]
    times = []
    for s in range(warmup + steps):
        chunks = [ScheduledChunk(f"r{i}", [100 + i], context + s, tables[i], True, sampling, s) for i in range(batch)]
        out = runner.execute(SchedulerOutput(chunks))
        if s >= warmup:
            times.append(out.step_s)
    for t in tables:
        pool.free(t)
    return statistics.median(times) * 1000


def bench_prefill(runner, tokens: int, start_pos: int, steps: int) -> float:
    """One chunk of ``tokens`` prompt tokens at ``start_pos`` (0: a fresh prompt; else a continuation)."""
    pool = KVPool(runner.num_blocks, runner.block_size)
    table = pool.allocate(pool.blocks_for(start_pos + tokens))
    greedy = SamplingParams(temperature=0.0)
    times = []
    for s in range(steps + 1):
        chunk = ScheduledChunk(f"p{s}", list(range(100, 100 + tokens)), start_pos, table, True, greedy, 0)
        out = runner.execute(SchedulerOutput([chunk]))
        if s:
            times.append(out.step_s)
    pool.free(table)
    return statistics.median(times) * 1000
