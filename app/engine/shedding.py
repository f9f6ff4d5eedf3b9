"""Load shedding for a latency pool (``EngineConfig.max_queue_delay_ms``): refuse a new request
rather than queue it where its first token would come too late. Three tests, because each lags
where the next does not:

- the oldest request still without its first token has waited past the limit;
- the requests waiting for their first token, at the rate the engine gave first tokens while it
  had such a backlog (Little's law: the wait of a new arrival), would take past the limit. A burst
  is otherwise taken whole before anyone has waited long; the rate is measured only over steps
  that began with a backlog, so an idle engine's pace never makes a lone request look late, and
  a pool bound by its KV (admitting one request as another ends) shows its real, slow rate.
- the new request's first token is past the limit (``first_token_steps``), at the engine's recent
  step time: room for it, behind the waiting ones, frees too late (its KV reservation and a place
  in the running batch, ``max_num_seqs`` or the online scheduler's TPOT cap; the running answers
  free theirs at their predicted ends, the waiting ones, started as room frees, at theirs), or the
  prompts ahead of it and its own take too long to compute in what each step's token budget
  leaves after the running answers' decodes, each such step at the time of a full one
  (``Scheduler.prompt_step_s``: on a CPU several times a decode-only step). The rate lags when
  long answers fill the KV or the batch, or the decodes fill the steps: it still reads the pace
  from before.

All three estimate at admission, and steps that slow down after it (more answers in the batch,
other processes on the cores) make them late. So an admitted request that has not started (no
KV, nothing computed) is refused once its first token can no longer come within the limit: its
wait and its own prompt's steps at the recent step time (``late``), as Triton's queue policy
rejects on timeout, a prefill early. An answer started later would miss the TTFT objective the
limit stands for, and its steps would delay the answers that can still meet theirs.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from app.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from app.engine.scheduler.base import Scheduler

WINDOW_S = 30.0  # the backlog steps the rate is read from (step time, newest last)
MIN_WINDOW_S = 1.0  # less backlog than this seen: no rate yet


def steps_until_admitted(need_tokens: int, free_tokens: int, running: Iterable[tuple[int, int]],
                         queue: Iterable[tuple[int, int]] = (), slots: int | None = None) -> int | None:
    """Decode steps until a request reserving ``need_tokens`` of KV can start, behind ``queue``,
    the requests waiting ahead of it in order: ``free_tokens`` now, and each running answer frees
    its tokens (and its place among at most ``slots`` running) when it ends; a queued request
    starts as soon as both are free and frees them at its own end. Both are ``(steps to its
    predicted end, tokens)``. None: it needs more than the whole pool."""
    ends = list(running)
    heapq.heapify(ends)
    step = 0
    for steps, tokens in [*queue, (None, need_tokens)]:
        while tokens > free_tokens or (slots is not None and len(ends) >= slots):
            if not ends:
                return None
            end, freed = heapq.heappop(ends)
            step, free_tokens = max(step, end), free_tokens + freed
        if steps is None:
            return step
        free_tokens -= tokens
        heapq.heappush(ends, (step + steps, tokens))
    raise AssertionError("unreachable")


def admission_wait_steps(new: Request, waiting: Iterable[Request], running: Iterable[Request],
                         reserve: Callable[[Request], int], capacity_tokens: int, max_running: int) -> int | None:
    """``steps_until_admitted`` for ``new`` behind every waiting request (oldest first), each
    reserving what the allocation policy plans for it (``reserve``: its ``reservation_tokens``;
    nothing for ``paged``, which preempts instead), at most ``max_running`` at once, while each
    running answer frees its reservation and its place at its predicted end."""
    def left(r: Request) -> int:
        return max(1, r.predicted_output_tokens - r.num_output_tokens)

    ends = [(left(r), reserve(r)) for r in running]
    free = capacity_tokens - sum(tokens for _, tokens in ends)
    queue = [(left(r), reserve(r)) for r in sorted(waiting, key=lambda r: r.arrival_s)]
    return steps_until_admitted(reserve(new), free, ends, queue, max_running)


def prefill_steps(new: Request, running: Iterable[Request], waiting: Iterable[Request], budget: int) -> int:
    """Steps until ``new``'s prompt is computed behind every prompt not yet through (waiting, or
    part-way in the running batch; an answer resumed or preempted is one again until its tokens so
    far are computed): each step carries the running answers' decodes first (one token each) and
    prompt chunks in what is left of its token ``budget`` (at least one token)."""
    running = list(running)
    ahead = sum(left for r in running if (left := r.num_tokens - r.num_computed_tokens) > 1)
    ahead += sum(r.num_tokens - r.num_computed_tokens for r in waiting)
    return math.ceil((ahead + new.num_tokens) / prompt_room(running, budget))


def own_prefill_steps(req: Request, room: int) -> int:
    """Steps to compute ``req``'s prompt alone once started (``prefill_steps`` without the prompts
    ahead), at ``room`` prompt tokens a step (``prompt_room``): the least time to its first token
    from its start."""
    return math.ceil(req.num_tokens / room)


def prompt_room(running: Iterable[Request], budget: int) -> int:
    """Prompt tokens a step carries: what its token ``budget`` leaves after the running answers'
    decodes (one token each), at least one."""
    decodes = sum(1 for r in running if r.num_tokens - r.num_computed_tokens <= 1)
    return max(1, budget - decodes)


def first_token_steps(new: Request, scheduler: Scheduler, reserve: Callable[[Request], int],
                      capacity_tokens: int) -> tuple[int, int] | None:
    """Steps before ``new``'s first token, at the least: (decode steps until room for it to start,
    ``admission_wait_steps``; steps until its prompt is computed, ``prefill_steps``): it comes
    after both. None: it needs more than the whole pool."""
    admit = admission_wait_steps(new, scheduler.waiting, scheduler.running, reserve, capacity_tokens,
                                 scheduler.max_running())
    if admit is None:
        return None
    return admit, prefill_steps(new, scheduler.running, scheduler.waiting, scheduler.step_token_budget())


def awaiting_first_token(requests: Iterable[Request]) -> Iterator[Request]:
    """The requests still without their first token (waiting, or in prefill): the backlog that the
    shedder, the engine's per-step rate and the autoscaler's ``oldest_pending_ms`` read."""
    return (r for r in requests if not r.output_token_ids)


class EngineOverloaded(RuntimeError):
    """The queue is past ``max_queue_delay_ms``; the request may be sent again later (429)."""


class LoadShedder:
    def __init__(self, limit_ms: float) -> None:
        self.limit_s = limit_ms / 1000
        self._steps: collections.deque[tuple[int, float]] = collections.deque()  # (first tokens, seconds)
        self._seconds = 0.0
        self._firsts = 0
        self.ready_s: float | None = None  # when the first step ended: waits before it are a cold start's

    def observe(self, backlog: bool, first_tokens: int, step_s: float, now_s: float) -> None:
        """One step (ended at ``now_s``): whether requests were waiting for their first token as it
        began, how many got it."""
        if self.ready_s is None:
            self.ready_s = now_s
        if not backlog or step_s <= 0:
            return
        self._steps.append((first_tokens, step_s))
        self._firsts += first_tokens
        self._seconds += step_s
        while self._seconds - self._steps[0][1] >= WINDOW_S:
            firsts, seconds = self._steps.popleft()
            self._firsts -= firsts
            self._seconds -= seconds

    @property
    def first_tokens_per_s(self) -> float | None:
        if self._seconds < MIN_WINDOW_S or not self._firsts:
            return None
        return self._firsts / self._seconds

    def check(self, requests: Iterable[Request], now_s: float) -> None:
        """Raise ``EngineOverloaded`` if a new request should be refused. Nothing is refused before
        the first step, and waits are counted from its end: a replica that just started (a
        replacement, with the requests queued while there was none) says nothing about its pace
        until it has stepped, and a backlog it is about to serve is no reason to turn work away."""
        if self.ready_s is None:
            return
        pending = [self.since_s(r) for r in awaiting_first_token(requests)]
        if not pending:
            return
        limit = f"past this pool's max_queue_delay_ms ({self.limit_s * 1000:g})"
        waited = now_s - min(pending)
        if waited > self.limit_s:
            raise EngineOverloaded(f"the oldest waiting request has waited {waited:.1f} s, {limit}")
        rate = self.first_tokens_per_s
        if rate and len(pending) / rate > self.limit_s:
            raise EngineOverloaded(f"{len(pending)} requests wait for a first token, given at {rate:.2f}/s: "
                                   f"{len(pending) / rate:.1f} s, {limit}")

    def late(self, waiting: Iterable[Request], now_s: float, prefill_s: Callable[[Request], float]) -> list[Request]:
        """The waiting requests never started (not preempted, not resumed: no KV was spent on them)
        whose first token can no longer come within the limit: their wait, counted from the first
        step's end as in ``check``, and ``prefill_s``, the least their own prompt takes once started,
        pass it."""
        if self.ready_s is None:
            return []
        return [r for r in waiting if r.status is RequestStatus.WAITING and not r.output_token_ids
                and r.num_computed_tokens == 0
                and now_s - self.since_s(r) + prefill_s(r) > self.limit_s]

    def since_s(self, req: Request) -> float:
        """When ``req``'s wait began, as the shedder counts it: its arrival, or the first step's end
        for a request that came before it (a cold start's wait is not the pool's pace)."""
        return req.arrival_s if self.ready_s is None else max(req.arrival_s, self.ready_s)

    def check_admission(self, wait_steps: tuple[int, int] | None, step_s: float | None,
                        prompt_step_s: float | None = None) -> None:
        """Raise ``EngineOverloaded`` if a new request's first token is past the limit: ``wait_steps``
        (``first_token_steps``) are the decode steps until room for it, at the recent ``step_s``
        (the scheduler's ``recent_step_s``), and the steps until its prompt is computed, each at
        ``prompt_step_s`` (``Scheduler.prompt_step_s``: such a step is full; default ``step_s``)."""
        # NOTE: no pace before the warm-up steps are past; None: more than the whole pool (refused as too long)
        if step_s is None or not wait_steps:
            return
        admit, prefill = wait_steps
        wait_s = max(admit * step_s, prefill * max(step_s, prompt_step_s or 0.0))
        if wait_s > self.limit_s:
            raise EngineOverloaded(f"this request's first token is about {wait_s:.1f} s away (room for it frees at the "
                                   f"running answers' predicted ends; the prompts ahead of it are computed in what "
                                   f"the steps leave), past this pool's max_queue_delay_ms ({self.limit_s * 1000:g})")
