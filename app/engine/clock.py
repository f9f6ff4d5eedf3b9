"""The engine's clock, injected: wall time for a real runner, modelled time for a simulated one.

Arrival, admission, first-token and finish times, the online scheduler's aging and the step trace
all read it. ``advance`` is called once per step with the step's duration: a wall clock has already
moved, a modelled clock moves by exactly that much.
"""

from __future__ import annotations

import time


class WallClock:
    """Seconds since the clock was made, measured."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, step_s: float) -> None:
        """Nothing to do: the step took its time."""

    def idle_until(self, t_s: float) -> None:
        raise RuntimeError("only a modelled clock can be moved")


class ModelledClock:
    """Seconds of modelled time: moves only by the steps' modelled durations and explicit idling."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, step_s: float) -> None:
        self.now_s += step_s

    def idle_until(self, t_s: float) -> None:
        """Let time pass with nothing to run (open-loop arrivals)."""
        self.now_s = max(self.now_s, t_s)


Clock = WallClock | ModelledClock
