"""Continuous batching with chunked prefill, shared by every scheduler.

Each step: running sequences first (decodes, then unfinished prefill chunks, each in the scheduler's
priority order), then admissions from the waiting queue, all under one per-step token budget.
Subclasses decide only *order* (`running_key`, `waiting_order`), *who yields* on a full
pool (the lowest-priority running sequence) and *how much* a step may carry (`step_token_budget`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.config import EngineConfig
from app.engine.kv.allocation import AllocationPolicy, Grow
from app.engine.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from app.engine.request import FINISH_REASONS, Request, RequestStatus
from app.engine.scheduler.step_time import StepTimeModel

STEP_EMA = 0.1  # weight of the newest step in the recent step time
WARMUP_STEPS = 8  # a replica's first steps carry one-time kernel warm-up: not its pace


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    overflow_preemptions: int = 0  # of which: outgrew a predicted reservation
    recomputed_tokens: int = 0
    scheduled_seqs: int = 0  # summed over steps (mean batch = scheduled_seqs / steps)
    scheduled_tokens: int = 0


class Scheduler:
    name = "base"
    # False: stop admitting at the first waiting request that does not fit (FCFS, no overtaking).
    skip_unfit = True
    # True when admission order depends on the clock (aging): fruitless attempts are not cached
    # (nor when the policy's room depends on the step: the timeline of reserve_predicted).
    time_sensitive = False

    def __init__(self, config: EngineConfig, policy: AllocationPolicy, clock: Callable[[], float]) -> None:
        self.config = config
        self.policy = policy
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []
        self._admit_seq = 0
        self._admit_order: dict[str, int] = {}
        self._fruitless_admit_state: tuple | None = None
        self._waiting_version = 0  # bumped whenever the waiting queue changes
        self.recent_step_s: float | None = None  # moving average of the step time, past the warm-up steps
        self._steps_observed = 0
        self.step_model = StepTimeModel()  # step time by the tokens a step carries

    # -- ordering hooks ----------------------------------------------------------------------
    def waiting_key(self) -> Callable[[Request], tuple]:
        """The sort key of admission's order, as of now."""
        return lambda r: (-r.priority, r.arrival_s)

    def waiting_order(self) -> list[Request]:
        """Waiting requests in the order admission should try them."""
        return sorted(self.waiting, key=self.waiting_key())

    def running_key(self, req: Request) -> tuple:
        """Sort key of running requests: first scheduled first, preempted last."""
        return (-req.priority, self._admit_order[req.request_id])

    def step_token_budget(self) -> int:
        """Tokens the next step may carry: decodes first, prompt chunks in what is left."""
        return self.config.max_num_batched_tokens

    def decode_step_budget(self) -> int:
        """Tokens a step may carry while answers decode in it (the online scheduler's TPOT cap)."""
        return self.config.max_num_batched_tokens

    def tpot_slack_s(self) -> float | None:
        """The least TPOT slack of the answers decoding (the online scheduler's); None: none spent."""
        return None

    def budget_within_slack(self, decodes: int, slack_s: float | None) -> int:
        """Tokens a step with ``decodes`` answers in it may carry while they have ``slack_s`` of TPOT
        slack (the online scheduler's; here the decode budget, whatever the slack)."""
        return self.decode_step_budget()

    def answer_slack_s(self, tokens_out: int, decoding_s: float, remaining: int, decodes: int) -> float | None:
        """An answer's TPOT slack (``tpot_slack.answer_slack_s``) in a batch of ``decodes``; None where the
        scheduler spends none."""
        return None

    def slack_after_step(self, slack_s: float | None, decodes: int, step_s: float) -> float | None:
        """``slack_s`` after a step of ``step_s`` with ``decodes`` answers in it."""
        return slack_s

    def max_running(self) -> int:
        return self.config.max_num_seqs

    def ahead_of(self, req: Request) -> list[Request]:
        """The waiting requests that admission would try before ``req`` (not yet queued), in order."""
        key = self.waiting_key()
        mine = key(req)
        return [r for r in sorted(self.waiting, key=key) if key(r) <= mine and r is not req]  # ties: the queued first

    def step_time_s(self, tokens: int) -> float | None:
        """Seconds a step of ``tokens`` takes, by the steps of that size run so far (the recent step
        time until the model has seen a few); None before the warm-up is past."""
        if self.recent_step_s is None:
            return None
        modelled = self.step_model.time_at(tokens)
        return self.recent_step_s if modelled is None else modelled

    def observe_step(self, num_tokens: int, step_s: float) -> None:
        """Feedback after each step: the step-time model, and the recent step time, which the
        online scheduler's aging and the load shedder read, past a replica's first ``WARMUP_STEPS``."""
        self._steps_observed += 1
        self.step_model.observe(num_tokens, step_s, self.clock())
        if step_s > 0 and self._steps_observed > WARMUP_STEPS:
            recent = self.recent_step_s
            self.recent_step_s = step_s if recent is None else (1 - STEP_EMA) * recent + STEP_EMA * step_s

    # -- queue management --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self._waiting_version += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (the engine decides stop or length; abort): free its blocks and forget it."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.policy.free(req)
        elif req.status.queued:
            self.waiting.remove(req)
            self._waiting_version += 1
        req.status = status
        req.finish_reason = FINISH_REASONS[status]
        req.finished_s = self.clock()
        self.requests.pop(req.request_id, None)
        self._admit_order.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _preempt(self, req: Request, overflow: bool) -> None:
        """Recompute-style preemption: drop the KV, send the request back to the waiting queue."""
        self.running.remove(req)
        self.policy.free(req)
        if overflow:
            self.policy.rebound(req)
            self.stats.overflow_preemptions += 1
        self.stats.preemptions += 1
        self.stats.recomputed_tokens += req.num_computed_tokens
        req.num_recomputed_tokens += req.num_computed_tokens
        req.num_preemptions += 1
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.append(req)
        self._waiting_version += 1
        # NOTE: the runner keeps the request's sampler state across a preemption, so a seeded
        # request draws the same random stream whether or not it was recomputed.

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.step_token_budget()
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        preempted = False
        self.policy.on_step()
        self.running.sort(key=self.running_key)

        # NOTE: decodes first, then prefill chunks, each in the scheduler's order (Sarathi-Serve's
        # stall-free batching): a decode is one token, a prefill chunk can take the whole budget.
        # Ordered by priority alone, the online scheduler let a short request's prompt chunks
        # take the step from the long answers already decoding, which stalled them (TPOT up,
        # tokens/s down). Victims still come from the end of ``running``, by priority.
        for req in sorted(self.running, key=lambda r: not r.decoding):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_new = min(req.uncomputed_tokens, budget)
            while True:
                result = self.policy.grow(req, num_new)
                if result is Grow.OK:
                    break
                if result is Grow.OVERFLOW:
                    self._preempt(req, overflow=True)
                    preempted = True
                    break
                victim = self._victim(exclude=scheduled)
                if victim is None or victim is req:  # last in line itself: it yields, not a prefill ahead of it
                    self._preempt(req, overflow=False)
                    preempted = True
                    break
                self._preempt(victim, overflow=False)
                preempted = True
            if req.status is RequestStatus.RUNNING:
                chunks.append(self._chunk(req, num_new))
                scheduled.add(req.request_id)
                budget -= num_new

        for req in self.running:
            if req.request_id not in scheduled and req.status is RequestStatus.RUNNING:
                self.policy.stalled(req)

        # NOTE: no admissions in a step that had to preempt: the pool is under pressure, and
        # admitting now would only thrash (vLLM does the same).
        if not preempted:
            budget = self._admit(chunks, budget)

        self.stats.steps += 1
        self.stats.scheduled_seqs += len(chunks)
        out = SchedulerOutput(chunks=chunks, finished_request_ids=self._finished_ids)
        self._finished_ids = []
        self.stats.scheduled_tokens += out.num_tokens
        return out

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> int:
        # NOTE: with thousands waiting (offline, simulator) sorting and first-fit every step
        # dominates; if the pool, the queue and the budget are as they were when the last attempt
        # admitted nothing, this one would admit nothing too.
        state = (self.policy.pool.num_free_blocks, self._waiting_version, len(self.running), budget, self._admit_seq)
        if not self.waiting or state == self._fruitless_admit_state:
            return budget
        admitted_before = self._admit_seq
        budget = self._admit_ordered(chunks, budget)
        if self._admit_seq == admitted_before and not (self.time_sensitive or self.policy.time_sensitive):
            self._fruitless_admit_state = state
        return budget

    def _admit_ordered(self, chunks: list[ScheduledChunk], budget: int) -> int:
        skipped: list[Request] = []
        overtaken: list[Request] = []
        for req in self.waiting_order():
            if budget <= 0 or len(self.running) >= self.max_running():
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.policy.can_admit(req, num_new):
                if self.skip_unfit and not self.must_wait_for(req):
                    skipped.append(req)
                    continue
                break
            overtaken, skipped = overtaken + skipped, []
            self.policy.admit(req, num_new)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.admitted_s is None:
                req.admitted_s = self.clock()
            self._admit_seq += 1
            self._admit_order[req.request_id] = self._admit_seq
            self.running.append(req)
            chunks.append(self._chunk(req, num_new))
            budget -= num_new
        for req in overtaken:
            req.num_overtaken += 1
        return budget

    def must_wait_for(self, req: Request) -> bool:
        """True if nothing may overtake ``req`` (anti-starvation for schedulers that skip)."""
        return False

    def _victim(self, exclude: set[str]) -> Request | None:
        for req in reversed(self.running):  # running is sorted: lowest priority last
            if req.request_id not in exclude:
                return req
        return None

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids(start, start + num_new),
            start_pos=start,
            block_ids=self.policy.block_ids(req),
            sample=start + num_new == req.num_tokens,
            sampling=req.sampling,
            num_output_tokens=req.num_output_tokens,
        )

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens and append sampled tokens; the engine then decides who ends.

        Returns the requests that received a token this step.
        """
        now = self.clock()
        touched: list[Request] = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(chunk.token_ids)
            if not chunk.sample:
                continue
            token = result.sampled_token_ids[chunk.request_id]
            if token is None:
                continue  # a row the runner could not sample: the engine ends this request
            req.output_token_ids.append(token)
            if req.first_token_s is None:
                req.first_token_s = now
            touched.append(req)
        return touched
