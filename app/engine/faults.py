"""Faults injected on purpose (``foreserve chaos``): the engine's forward raising as a kernel or a
device fault would. Off unless ``EngineConfig.fault_dir`` names a folder; then a file named
``forward_error`` there makes the next step raise, and is removed, so the replica that replaces the
crashed one serves normally. One ``stat`` per step when on."""

from __future__ import annotations

from pathlib import Path

FORWARD_ERROR = "forward_error"


class InjectedFault(RuntimeError):
    """A fault ``foreserve chaos`` asked for."""


class FaultFile:
    def __init__(self, folder: str) -> None:
        self.path = Path(folder) / FORWARD_ERROR

    def before_forward(self) -> None:
        if self.path.exists():
            self.path.unlink(missing_ok=True)
            raise InjectedFault(f"injected forward fault ({self.path} was there)")
