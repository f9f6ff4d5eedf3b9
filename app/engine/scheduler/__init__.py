"""Schedulers, in a registry keyed by the string used in YAML and on the CLI."""

from __future__ import annotations

from app.config import SCHEDULER_NAMES
from app.engine.scheduler.base import Scheduler, SchedulerStats
from app.engine.scheduler.fcfs import FCFSScheduler
from app.engine.scheduler.offline import OfflineScheduler
from app.engine.scheduler.online import OnlineScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (FCFSScheduler, OfflineScheduler, OnlineScheduler)
}
assert tuple(sorted(SCHEDULERS)) == tuple(sorted(SCHEDULER_NAMES)), "app.config.SCHEDULER_NAMES is out of date"

__all__ = ["SCHEDULERS", "Scheduler", "SchedulerStats", "make_scheduler"]


def make_scheduler(name: str, *args, **kwargs) -> Scheduler:
    try:
        cls = SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}") from None
    return cls(*args, **kwargs)
