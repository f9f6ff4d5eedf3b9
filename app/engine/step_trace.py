"""The step trace: one JSONL line per engine step (composition, forward time, the interval since the
previous step, the scheduler's budget) in ``DIR/steps-<scheduler>-<pid>.jsonl``, for finding where
a step's time goes and for fitting the cost model to served steps (``foreserve plan calibrate-cpu --trace``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from app.engine.outputs import SchedulerOutput


class StepTrace:
    def __init__(self, folder: str, scheduler_name: str) -> None:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"steps-{scheduler_name}-{os.getpid()}.jsonl")
        self._file = open(path, "a", buffering=1)  # NOTE: line-buffered: a killed replica keeps its lines
        self._last_step_end: float | None = None

    def write(self, now: float, sched_out: SchedulerOutput, forward_s: float, scheduler, pool) -> None:
        decode = sum(1 for c in sched_out.chunks if len(c.token_ids) == 1 and c.num_output_tokens > 0)
        record = {
            "t": round(now, 4),
            # NOTE: step end to step end: what a streaming client sees between tokens
            "interval_s": round(now - self._last_step_end, 4) if self._last_step_end is not None else None,
            "forward_s": round(forward_s, 4),
            "decode_rows": decode,
            "prefill_tokens": sched_out.num_tokens - decode,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "budget": scheduler.step_token_budget(),
            "max_running": scheduler.max_running(),
            "kv_free_tokens": pool.num_free_blocks * pool.block_size_tokens,
            # (cached tokens, new tokens, sampled) per sequence: enough to re-cost the step (plan calibrate-cpu)
            "chunks": [[c.start_pos, len(c.token_ids), int(c.sample)] for c in sched_out.chunks],
        }
        self._file.write(json.dumps(record) + "\n")
        self._last_step_end = now

    def close(self) -> None:
        self._file.close()


def read_steps(paths: list[str | Path]) -> list[dict]:
    """Every step recorded in these trace files, in order; ValueError naming the file and line of
    one that is not a step-trace line."""
    steps = []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            try:
                step = json.loads(line)
                step["forward_s"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a step-trace line ({exc!r})") from None
            steps.append(step)
    return steps
