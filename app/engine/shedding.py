"""Load shedding for a latency pool (``EngineConfig.max_queue_delay_ms``, the TTFT objective).

The rule: a request is refused only when the wait that others cause pushes its first token past
the limit and it would have met the limit otherwise. Refusing a request with nothing ahead of it
helps no one, however long its own prompt: its only alternative is no answer. A prompt whose own
prefill alone takes longer than the limit cannot meet it on any pool; it is refused only when the
wait others cause is itself past the limit (the pool is behind by more than the limit for
everyone), or it would queue without bound under an overload of long prompts.

Both are read off one estimate (app/engine/ttft.py): the new request's first token were it queued
now, and its own prompt's time alone. A request refused at admission never enters the queue (the
ingress's 429 with Retry-After). Steps can slow after admission (more answers in the batch, other
processes on the cores), so an admitted request that has not started (no KV, nothing computed) is
refused by the same rule once its wait so far, a lower bound on the wait others cause it, leaves
its own prompt no time (``late``), as Triton's queue policy rejects on timeout: an answer started
then would miss the objective, and its steps would delay the answers that can still meet theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from app.engine.request import Request, RequestStatus
from app.engine.ttft import FirstTokenEstimate


def awaiting_first_token(requests: Iterable[Request]) -> Iterator[Request]:
    """The requests still without their first token (waiting, or in prefill): the backlog that the
    autoscaler's ``oldest_pending_ms`` reads."""
    return (r for r in requests if not r.output_token_ids)


class EngineOverloaded(RuntimeError):
    """The wait others cause would push this request's first token past ``max_queue_delay_ms``;
    it may be sent again later (429)."""


class LoadShedder:
    def __init__(self, limit_ms: float) -> None:
        self.limit_s = limit_ms / 1000
        self.ready_s: float | None = None  # when the first step ended: waits before it are a cold start's

    def stepped(self, now_s: float) -> None:
        if self.ready_s is None:
            self.ready_s = now_s

    def allowed_delay_s(self, own_s: float) -> float:
        """The most the wait that others cause may be for a request whose own prompt takes ``own_s``:
        what the limit leaves after its own prompt, or the whole limit for a prompt that alone takes longer."""
        return self.limit_s - own_s if own_s <= self.limit_s else self.limit_s

    def check_admission(self, estimate: FirstTokenEstimate | None) -> None:
        """Raise ``EngineOverloaded`` if the wait others cause (``estimate``, None before the pool
        knows its pace) is more than this request may be given."""
        if estimate is None or estimate.delay_s <= self.allowed_delay_s(estimate.own_s):
            return
        limit = f"past this pool's max_queue_delay_ms ({self.limit_s * 1000:g})"
        about = "about" if estimate.complete else "more than"
        if estimate.own_s <= self.limit_s:
            raise EngineOverloaded(
                f"this request's first token is {about} {estimate.total_s:.1f} s away, {estimate.delay_s:.1f} s of it for "
                f"others ahead (alone it takes {estimate.own_s:.1f} s), {limit}")
        raise EngineOverloaded(
            f"the others ahead of this request would delay its first token by {about} {estimate.delay_s:.1f} s, {limit} "
            f"(its own prompt takes {estimate.own_s:.1f} s)")

    def late(self, waiting: Iterable[Request], now_s: float, own_s: Callable[[Request], float | None]) -> list[Request]:
        """The waiting requests never started (not preempted, not resumed: no KV was spent on them)
        whose wait, counted from the first step's end, is past what the rule allows them, their own
        prompt taking ``own_s`` (None: not known yet, never late)."""
        if self.ready_s is None:
            return []
        late = []
        for r in waiting:
            if r.status is not RequestStatus.WAITING or r.output_token_ids or r.num_computed_tokens:
                continue
            own = own_s(r)
            if own is not None and now_s - self.since_s(r) > self.allowed_delay_s(own):
                late.append(r)
        return late

    def since_s(self, req: Request) -> float:
        """When ``req``'s wait began, as the shedder counts it: its arrival, or the first step's end
        for a request that came before it (a cold start's wait is not the pool's pace)."""
        return req.arrival_s if self.ready_s is None else max(req.arrival_s, self.ready_s)
