"""MeasuredRunner: the simulator with step times read off a real engine's step trace.

The roofline of ``SimRunner`` has two constants; on a shared CPU its shape is wrong where the
scheduler's choices are made (decode steps of 1-3 rows came out 45-58% slow, 8-15 rows 37% fast:
``plan calibrate-cpu --from-trace``). This runner times a step as the traced service timed steps of
the same size: the median forward time per bin of step tokens (decode rows plus prefill tokens),
separately for decode-only steps and steps that carry a prefill chunk, interpolated linearly between
bins and, past the largest bin, proportional to the tokens (the last bin's time per token).

The trace is what the engines write under ``FORESERVE_STEP_TRACE`` (one JSON line per step with
``decode_rows``, ``prefill_tokens`` and ``forward_s``).
"""

from __future__ import annotations

import bisect
import statistics
from pathlib import Path

from app.engine.outputs import ModelRunnerOutput, SchedulerOutput
from app.engine.scheduler.online import STEP_BINS as BINS  # the online scheduler's own bins of step sizes
from app.engine.sim.runner import DUMMY_TOKEN_ID, SimRunner
from app.engine.step_trace import read_steps

MIN_STEPS_PER_BIN = 3  # a bin seen fewer times is left out of the curve (too noisy to time)


class StepCurve:
    """Step seconds as a piecewise-linear function of a step's tokens, from (tokens, seconds) samples."""

    def __init__(self, samples: list[tuple[int, float]]) -> None:
        by_bin: dict[int, list[tuple[int, float]]] = {}
        for tokens, seconds in samples:
            if tokens > 0:
                by_bin.setdefault(bisect.bisect_right(BINS, tokens) - 1, []).append((tokens, seconds))
        self.points = [
            (statistics.mean(t for t, _ in group), statistics.median(s for _, s in group))
            for _, group in sorted(by_bin.items()) if len(group) >= MIN_STEPS_PER_BIN
        ]

    def __bool__(self) -> bool:
        return bool(self.points)

    def seconds(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        if tokens >= pts[-1][0]:
            return pts[-1][1] * tokens / pts[-1][0]
        i = bisect.bisect_right([x for x, _ in pts], tokens)
        (xa, ta), (xb, tb) = pts[i - 1], pts[i]
        return ta + (tb - ta) * (tokens - xa) / (xb - xa)


def read_step_trace(paths: list[str | Path]) -> tuple[StepCurve, StepCurve]:
    """(decode-only, with-prefill) curves of the steps in these trace files."""
    decode, mixed = [], []
    for step in read_steps(paths):
        tokens = step["decode_rows"] + step["prefill_tokens"]
        (mixed if step["prefill_tokens"] else decode).append((tokens, step["forward_s"]))
    curves = StepCurve(decode), StepCurve(mixed)
    if not (curves[0] or curves[1]):
        raise ValueError(f"no bin of step sizes has {MIN_STEPS_PER_BIN} steps in {[str(p) for p in paths]}")
    return curves


class MeasuredRunner(SimRunner):
    """``SimRunner`` (its memory model: KV bytes per token, pool size) timed by a measured step curve."""

    def __init__(self, base: SimRunner, decode: StepCurve, mixed: StepCurve, source: str = "trace") -> None:
        self.__dict__.update(base.__dict__)
        self.decode, self.mixed, self.source = decode or mixed, mixed or decode, source

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        chunks = scheduler_output.chunks
        tokens = sum(len(c.token_ids) for c in chunks)
        prefill = any(len(c.token_ids) > 1 or not c.sample for c in chunks)
        step_s = (self.mixed if prefill else self.decode).seconds(tokens) if tokens else self._overhead_s
        return ModelRunnerOutput(sampled_token_ids={c.request_id: DUMMY_TOKEN_ID for c in chunks if c.sample},
                                 step_s=step_s)

    def describe(self) -> dict:
        return dict(super().describe(), hardware=f"steps measured in {self.source}",
                    decode_curve=[(round(x, 1), round(t * 1000, 1)) for x, t in self.decode.points],
                    prefill_curve=[(round(x, 1), round(t * 1000, 1)) for x, t in self.mixed.points])
