"""A deterministic stand-in for the model: drives the scheduler without torch.

It writes a marker for every (request, position) into a dict keyed by physical KV slot and checks,
for every chunk, that the sequence's earlier positions are still intact in its blocks: any block
shared between live sequences or freed too early shows up as a corrupted read.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from app.engine.outputs import ModelRunnerOutput, SchedulerOutput
from app.engine.runner import Runner

EOS = 2


class KVCorruption(AssertionError):
    pass


class FakeRunner(Runner):
    simulated = True  # the engine clock advances by step_s per step, deterministically
    eos_token_id = EOS

    def __init__(self, block_size: int, step_s: float | Callable[[SchedulerOutput], float] = 0.01,
                 eos_at: dict[str, int] | None = None) -> None:
        """``step_s``: every step's time, or a function of the step (a cost model)."""
        self.block_size = block_size
        self.step_s = step_s
        self.eos_at = eos_at or {}  # request_id -> output length at which EOS is sampled
        self.slots: dict[int, tuple[str, int, int]] = {}  # slot -> (request_id, position, token)
        self.steps: list[SchedulerOutput] = []

    @staticmethod
    def token_for(request_id: str, position: int) -> int:
        # NOTE: crc32, not hash(): str hashes are salted per process (PYTHONHASHSEED), so hash() gave
        # each run, and each Ray worker, different tokens (tests/unit/test_fake_runner.py checks this)
        return 10 + zlib.crc32(f"{request_id}\x00{position}".encode()) % 1000

    def _slot(self, block_ids: list[int], pos: int) -> int:
        idx = pos // self.block_size
        if idx >= len(block_ids):
            raise KVCorruption(f"position {pos} is beyond the block table ({len(block_ids)} blocks)")
        return block_ids[idx] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        sampled: dict[str, int] = {}
        for c in out.chunks:
            for pos in range(c.start_pos):
                held = self.slots.get(self._slot(c.block_ids, pos))
                if held is None or held[:2] != (c.request_id, pos):
                    raise KVCorruption(f"{c.request_id} pos {pos}: slot holds {held}")
            for i, tok in enumerate(c.token_ids):
                pos = c.start_pos + i
                self.slots[self._slot(c.block_ids, pos)] = (c.request_id, pos, tok)
            if c.sample:
                n_out = c.num_output_tokens
                if self.eos_at.get(c.request_id) == n_out + 1:
                    sampled[c.request_id] = EOS
                else:
                    sampled[c.request_id] = self.token_for(c.request_id, c.start_pos + len(c.token_ids))
        return ModelRunnerOutput(sampled_token_ids=sampled, step_s=self.step_s(out) if callable(self.step_s) else self.step_s)
