"""A new request's time to first token, estimated at its admission by playing the coming steps
forward: what the load shedder decides by (app/engine/shedding.py), and what every answered
request reports beside its measured time to first token.

Each step carries the running answers' decodes first (one token each), then prompt chunks in what
its token budget leaves (``Scheduler.step_token_budget``: the whole ``max_num_batched_tokens``
while nothing decodes, while answers do the online scheduler's TPOT cap or what their TPOT slack
allows, the slack spent as the steps played forward take it), in the order admission
takes them: the prompts in the running batch, the waiting requests ahead of the new one, then its
own. A prompt through becomes a decode until its predicted end; a running answer ends at its own.
A queued prompt starts no earlier than room for it frees (``queue_start_steps``: its KV
reservation and a place in the batch). Each step is priced at what steps of its size took
(``Scheduler.step_time_s``), never at one fixed step time: a chunk of 256 prompt tokens on a CPU
takes many times a decode-only step.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.engine.request import Request

if TYPE_CHECKING:
    from app.engine.scheduler.base import Scheduler

MAX_STEPS = 20_000  # a bound on the play-forward; an estimate that long is past any limit


@dataclass(frozen=True, slots=True)
class FirstTokenEstimate:
    total_s: float  # with the work ahead of it
    own_s: float  # its own prompt alone, on an idle pool
    complete: bool = True  # False: the play-forward stopped early, and total_s is a lower bound

    @property
    def delay_s(self) -> float:
        """The wait that others cause."""
        return max(0.0, self.total_s - self.own_s)


def admission_steps(need_tokens: int, free_tokens: int, running: list[tuple[int, int]],
                    queue: list[tuple[int, int]] = (), slots: int | None = None) -> list[int] | None:
    """The decode steps until each of ``queue`` (the requests waiting, in admission's order), then a
    request reserving ``need_tokens`` of KV, can start: ``free_tokens`` now, and each running answer
    frees its tokens (and its place among at most ``slots`` running) when it ends; a queued request
    starts as soon as both are free and frees them at its own end. Both are ``(steps to its predicted
    end, tokens)``. None: the last needs more than the whole pool."""
    ends = list(running)
    heapq.heapify(ends)
    step, starts = 0, []
    for steps, tokens in [*queue, (None, need_tokens)]:
        while tokens > free_tokens or (slots is not None and len(ends) >= slots):
            if not ends:
                return None
            end, freed = heapq.heappop(ends)
            step, free_tokens = max(step, end), free_tokens + freed
        starts.append(step)
        if steps is not None:
            free_tokens -= tokens
            heapq.heappush(ends, (step + steps, tokens))
    return starts


def steps_left(req: Request) -> int:
    """Steps to its predicted end, counting the one that samples its next token."""
    return max(1, req.predicted_output_tokens - req.num_output_tokens)


def queue_start_steps(new: Request, ahead: list[Request], running: list[Request], reserve: Callable[[Request], int],
                      capacity_tokens: int, max_running: int) -> list[int] | None:
    """``admission_steps`` for ``ahead`` (the waiting requests admission tries first), then ``new``,
    each reserving what the allocation policy plans for it (``reserve``: its ``reservation_tokens``;
    nothing for ``paged``, which preempts instead), at most ``max_running`` at once, while each
    running answer frees its reservation and its place at its predicted end."""
    ends = [(steps_left(r), reserve(r)) for r in running]
    free = capacity_tokens - sum(tokens for _, tokens in ends)
    queue = [(steps_left(r), reserve(r)) for r in ahead]
    return admission_steps(reserve(new), free, ends, queue, max_running)


def own_ttft_s(req: Request, scheduler: Scheduler) -> float | None:
    """Seconds to ``req``'s first token on an idle pool: its prompt in chunks of the whole step
    budget, each priced at steps of that size. None before the scheduler knows its pace."""
    budget = scheduler.config.max_num_batched_tokens
    full, rest = divmod(req.uncomputed_tokens, budget)
    chunk_s, rest_s = scheduler.step_time_s(budget), scheduler.step_time_s(rest) if rest else 0.0
    if chunk_s is None or rest_s is None:
        return None
    return full * chunk_s + rest_s


def estimate_ttft(new: Request, scheduler: Scheduler, reserve: Callable[[Request], int], capacity_tokens: int,
                  max_delay_s: float = float("inf")) -> FirstTokenEstimate | None:
    """Seconds to ``new``'s first token were it queued now (see the module's docstring), played
    forward until it, or until the wait others cause passes ``max_delay_s`` (the total is then where
    it stopped). None before the scheduler knows its pace, or where ``new`` needs more than the pool."""
    own = own_ttft_s(new, scheduler)
    if own is None:
        return None
    running = list(scheduler.running)
    ahead = scheduler.ahead_of(new)
    starts = queue_start_steps(new, ahead, running, reserve, capacity_tokens, scheduler.max_running())
    if starts is None:
        return None
    ends = [steps_left(r) for r in running if r.decoding]
    heapq.heapify(ends)
    # (request, prompt tokens left, the step from which room for it is free)
    prompts = deque((r, r.uncomputed_tokens, 0) for r in sorted(running, key=scheduler.running_key) if not r.decoding)
    prompts.extend((r, r.uncomputed_tokens, start) for r, start in zip([*ahead, new], starts))
    idle_budget, slack = scheduler.config.max_num_batched_tokens, scheduler.tpot_slack_s()
    total = 0.0
    for step in range(MAX_STEPS):
        while ends and ends[0] <= step:
            heapq.heappop(ends)
        decodes = len(ends)
        room = max(1, (scheduler.budget_within_slack(decodes, slack) if decodes else idle_budget) - decodes)
        taken, through = 0, []
        while prompts and taken < room and prompts[0][2] <= step:
            req, left, start = prompts[0]
            n = min(left, room - taken)
            taken += n
            if n == left:
                prompts.popleft()
                through.append(req)
            else:
                prompts[0] = (req, left - n, start)
        if not decodes and not taken:
            continue  # NOTE: nothing runs before its room frees (a pool the steps ahead do not free)
        step_s = scheduler.step_time_s(decodes + taken)
        total += step_s
        if through and through[-1] is new:
            return FirstTokenEstimate(total, own)
        if decodes:
            slack = scheduler.slack_after_step(slack, decodes, step_s)
        for req in through:  # a new answer: its slack joins the least
            heapq.heappush(ends, step + steps_left(req))
            fresh = scheduler.answer_slack_s(1, 0.0, steps_left(req), len(ends))
            slack = fresh if slack is None else (slack if fresh is None else min(slack, fresh))
        if total > own + max_delay_s:
            break
    return FirstTokenEstimate(total, own, complete=False)
