"""Reservations held in time: the KV tokens admitted sequences are predicted to hold at each
future decode step.

A sequence admitted at step ``s`` with ``c`` tokens and ``r`` more tokens to generate holds about
``c + t`` tokens at step ``s + t`` for ``t`` in ``[0, r]`` and nothing after. Summing those ramps
gives the pool's predicted occupancy; admitting a new sequence is safe if occupancy plus its
own ramp stays within capacity at every future step. Unlike holding every reservation's final
size from the start, this lets memory that a short sequence will release before a long one needs
it be promised to both: the batch grows to what physically fits, with no preemption as long as
the predictions hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Ramp:
    start_step: int
    tokens: int  # tokens held at start_step (prompt + output so far)
    steps: int  # decode steps covered

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


class Timeline:
    """Predicted occupancy in whole blocks (a sequence of ``n`` tokens holds ``ceil(n / bs)``)."""

    def __init__(self, capacity_blocks: int, block_size_tokens: int, horizon_steps: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size_tokens
        self.horizon = horizon_steps + 1
        self._usage = np.zeros(4 * self.horizon, dtype=np.int64)
        self._base = 0  # absolute step of _usage[0]
        self.now = 0
        self._ramp = np.arange(self.horizon, dtype=np.int64)
        self._room: np.ndarray | None = None  # cache of room_for(), valid until the next change

    def advance(self) -> None:
        """One decode step has passed."""
        self.now += 1
        self._room = None
        if self.now - self._base + 2 * self.horizon > len(self._usage):
            shift = self.now - self._base
            self._usage[:-shift] = self._usage[shift:]
            self._usage[-shift:] = 0
            self._base = self.now

    def _window(self, ramp: Ramp) -> tuple[slice, np.ndarray]:
        begin = max(self.now, ramp.start_step)
        end = ramp.end_step + 1
        if end <= begin:
            return slice(0, 0), self._ramp[:0]
        offset = begin - ramp.start_step
        tokens = ramp.tokens + self._ramp[offset : offset + end - begin]
        return slice(begin - self._base, end - self._base), (tokens + self.block_size - 1) // self.block_size

    def room(self) -> np.ndarray:
        """``room[r]``: free tokens along the next ``r`` steps, net of a 1-token-per-step ramp.

        A sequence starting with ``c`` tokens and growing ``r`` steps surely fits if
        ``c + bs - 1 <= room[r]`` and surely does not if ``c > room[r]``.
        """
        if self._room is None:
            i = self.now - self._base
            free = (self.capacity_blocks - self._usage[i : i + self.horizon]) * self.block_size - self._ramp
            self._room = np.minimum.accumulate(free)
        return self._room

    def fits(self, tokens: int, steps: int) -> bool:
        steps = min(steps, self.horizon - 1)
        room = self.room()[steps]
        if tokens > room:
            return False
        if tokens + self.block_size - 1 <= room:
            return True
        i = self.now - self._base  # NOTE: the exact block staircase, only near the boundary
        need = (tokens + self._ramp[: steps + 1] + self.block_size - 1) // self.block_size
        return bool((self._usage[i : i + steps + 1] + need).max() <= self.capacity_blocks)

    def add(self, tokens: int, steps: int) -> Ramp:
        ramp = Ramp(self.now, tokens, min(steps, self.horizon - 1))
        window, values = self._window(ramp)
        self._usage[window] += values
        self._room = None
        return ramp

    def remove(self, ramp: Ramp) -> None:
        """Release what remains of a ramp (sequence finished, preempted or re-planned)."""
        window, values = self._window(ramp)
        self._usage[window] -= values
        self._room = None

    def occupancy(self, step: int) -> int:
        return int(self._usage[step - self._base])
