"""Throughput scheduler for the offline pool: S3's packing by predicted length.

The waiting queue is packed into free KV memory by decreasing first-fit on each request's
reservation (prompt + predicted output): the largest predicted sequences are placed first and the
remaining holes are filled with smaller ones, so the batch is as large as memory allows. A request
that smaller ones have overtaken ``max_overtakes`` times makes the queue wait until it fits, so a
steady stream of small requests cannot starve a large one.
"""

from __future__ import annotations

from collections.abc import Callable

from app.engine.request import Request
from app.engine.scheduler.base import Scheduler


class OfflineScheduler(Scheduler):
    name = "offline"
    skip_unfit = True

    def waiting_key(self) -> Callable[[Request], tuple]:
        reserve = self.policy.reservation_tokens
        return lambda r: (-r.priority, -reserve(r), r.arrival_s)

    def must_wait_for(self, req: Request) -> bool:
        return req.num_overtaken >= self.config.max_overtakes
