"""ReplayRunner: replays a recorded trace's answer lengths through any runner (benchmarks and the
capacity models), so the engine itself knows nothing of "true" lengths.

Each request named in ``lengths`` ends exactly at its recorded length: the wrapper makes the token
sampled at that length the end-of-sequence token, and replaces an end-of-sequence token sampled
before it by another one. The engine sees an ordinary stop (finish reason ``stop``); its
reservations, preemptions and finish decisions run as they do in serving. The requests must not
set ``ignore_eos``. Requests not in ``lengths`` pass through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping

from app.engine.outputs import ModelRunnerOutput, SchedulerOutput
from app.engine.runner import Runner

REPLAY_EOS = -1  # the end token of a runner that has none (the simulator samples a dummy token)


class ReplayRunner(Runner):
    def __init__(self, runner: Runner, lengths: Mapping[str, int] | None = None) -> None:
        self.inner = runner
        self.lengths: dict[str, int] = dict(lengths or {})
        self.simulated = runner.simulated
        self.eos_token_id = REPLAY_EOS if runner.eos_token_id is None else runner.eos_token_id
        self.eos_token_ids = frozenset({self.eos_token_id})
        self._inner_ends = runner.eos_token_ids | {self.eos_token_id}
        self._other_token = min(set(range(len(self._inner_ends) + 1)) - self._inner_ends)

    def __getattr__(self, name: str):  # the wrapped runner's tokenizer, kv_bytes_per_token, ...
        return getattr(self.inner, name)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self.inner.execute(scheduler_output)
        sampled = out.sampled_token_ids
        for chunk in scheduler_output.chunks:
            length = self.lengths.get(chunk.request_id)
            if length is None or not chunk.sample:
                continue
            if chunk.num_output_tokens + 1 >= length:
                sampled[chunk.request_id] = self.eos_token_id
            elif sampled[chunk.request_id] in self._inner_ends:
                sampled[chunk.request_id] = self._other_token
        return out

    def shutdown(self) -> None:
        self.inner.shutdown()
