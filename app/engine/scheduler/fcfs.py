"""First come, first served: the comparison baseline (no overtaking, LIFO victims)."""

from __future__ import annotations

from app.engine.scheduler.base import Scheduler


class FCFSScheduler(Scheduler):
    name = "fcfs"
    skip_unfit = False
