"""KV allocation policies: "does this fit / give me blocks / can it grow".

Every policy counts blocks of the replica's one `KVPool`, so what it accounts is what is
physically held. The scheduler decides order and victims; it never sees block internals.

- ``reserve_max``: reserve prompt + max_tokens at admission (FasterTransformer/ORCA baseline).
- ``paged``: allocate on demand; when the pool runs dry the scheduler preempts (vLLM).
- ``reserve_predicted``: reserve prompt + predicted bound; on overflow grow into unreserved
  memory if any, else the sequence is preempted and re-admitted with the next bucket's bound (S3).
  The reservation is held *in time* (see `timeline.py`): the sequence is promised the tokens its
  predicted trajectory needs at each future step, and blocks are bound to it as it grows, so
  memory a short sequence will have released is promised again to a longer one.
- ``oracle``: the same with the true output length (benchmarks: the limit of prediction).
"""

from __future__ import annotations

import enum

from app.engine.kv.pool import KVPool
from app.engine.request import Request
from app.engine.kv.timeline import Ramp, Timeline
from predictor.buckets import LengthBuckets


class Grow(enum.Enum):
    OK = "ok"  # the sequence has blocks for the tokens it asked for
    POOL_DRY = "pool_dry"  # no free blocks: the scheduler must preempt someone
    OVERFLOW = "overflow"  # outgrew its reservation and no free block is left: preempt it, re-admit larger


class AllocationPolicy:
    """Base policy: a block table per running request, on one pool."""

    name = "base"
    reserves = True  # reserve the whole expected sequence at admission
    watermark_blocks = 0  # blocks kept free at admission so running sequences can grow
    time_sensitive = False  # True: whether a request fits changes as steps pass, not only as blocks do

    def __init__(self, pool: KVPool, buckets: LengthBuckets, max_seq_tokens: int = 4096) -> None:
        self.pool = pool
        self.buckets = buckets
        self.max_seq_tokens = max_seq_tokens
        self._tables: dict[str, list[int]] = {}

    def on_step(self) -> None:
        """Called once at the start of every scheduling step."""

    def stalled(self, req: Request) -> None:
        """Called for each running request this step did not advance (the step's token budget ran out)."""

    # -- what a policy decides -------------------------------------------------------------
    def reservation_tokens(self, req: Request) -> int:
        """Prompt + output tokens the policy plans for ``req`` (what it binds at admission if ``reserves``)."""
        raise NotImplementedError

    def rebound(self, req: Request) -> None:
        """Called when ``req`` overflowed and was preempted: widen its guess before re-admission."""

    # -- the interface the scheduler uses --------------------------------------------------
    def _target_blocks(self, req: Request, num_new_tokens: int) -> int:
        need = req.num_computed_tokens + num_new_tokens
        if self.reserves:
            need = max(need, min(self.reservation_tokens(req), req.max_total_tokens))
        return self.pool.blocks_for(need)

    def can_admit(self, req: Request, num_new_tokens: int) -> bool:
        return self._target_blocks(req, num_new_tokens) + self.watermark_blocks <= self.pool.num_free_blocks

    def admit(self, req: Request, num_new_tokens: int) -> None:
        if req.request_id in self._tables:
            raise RuntimeError(f"request {req.request_id} is already admitted")
        self._tables[req.request_id] = self.pool.allocate(self._target_blocks(req, num_new_tokens))

    def grow(self, req: Request, num_new_tokens: int) -> Grow:
        """Make room for ``num_new_tokens`` more tokens of a running request."""
        table = self._tables[req.request_id]
        extra = self.pool.blocks_for(req.num_computed_tokens + num_new_tokens) - len(table)
        if extra <= 0:
            return Grow.OK
        if extra <= self.pool.num_free_blocks:
            table.extend(self.pool.allocate(extra))
            return Grow.OK
        return Grow.OVERFLOW if self.reserves else Grow.POOL_DRY

    def free(self, req: Request) -> None:
        table = self._tables.pop(req.request_id, None)
        if table:
            self.pool.free(table)

    def block_ids(self, req: Request) -> list[int]:
        return self._tables[req.request_id]


class ReserveMax(AllocationPolicy):
    name = "reserve_max"

    def reservation_tokens(self, req: Request) -> int:
        return req.max_total_tokens


class Paged(AllocationPolicy):
    name = "paged"
    reserves = False

    def __init__(self, pool: KVPool, buckets: LengthBuckets, max_seq_tokens: int = 4096) -> None:
        super().__init__(pool, buckets, max_seq_tokens)
        # NOTE: vLLM keeps ~1% of the pool free at admission so that freshly admitted
        # sequences can decode a few steps before the pool runs dry and forces preemption.
        self.watermark_blocks = max(1, pool.num_blocks // 100)

    def reservation_tokens(self, req: Request) -> int:
        return 0


class ReservePredicted(AllocationPolicy):
    name = "reserve_predicted"
    reserves = False  # blocks are bound on demand; the promise is kept by the timeline
    time_sensitive = True  # room opens as admitted sequences near their predicted end

    def __init__(self, pool: KVPool, buckets: LengthBuckets, max_seq_tokens: int = 4096) -> None:
        super().__init__(pool, buckets, max_seq_tokens)
        self.timeline = Timeline(pool.num_blocks, pool.block_size_tokens, horizon_steps=max_seq_tokens)
        self._ramps: dict[str, Ramp] = {}
        self._anchored: set[str] = set()

    def predicted_total_tokens(self, req: Request) -> int:
        """Prompt + the predicted output: where the promised trajectory ends."""
        return req.num_prompt_tokens + (req.predicted_output_tokens or req.sampling.max_tokens)

    def reservation_tokens(self, req: Request) -> int:
        return max(self.predicted_total_tokens(req), req.num_tokens + 1)

    def rebound(self, req: Request) -> None:
        bound = self.buckets.next_bound_tokens(req.num_output_tokens)
        req.predicted_output_tokens = min(max(bound, req.num_output_tokens + 1), req.sampling.max_tokens)

    def on_step(self) -> None:
        self.timeline.advance()

    def _plan(self, req: Request) -> tuple[int, int]:
        """(tokens now, steps to go) of the request's predicted trajectory."""
        tokens = req.num_tokens
        return tokens, max(self.reservation_tokens(req) - tokens, 0)

    def can_admit(self, req: Request, num_new_tokens: int) -> bool:
        if self.pool.blocks_for(req.num_computed_tokens + num_new_tokens) > self.pool.num_free_blocks:
            return False
        return self.timeline.fits(*self._plan(req))

    def admit(self, req: Request, num_new_tokens: int) -> None:
        super().admit(req, num_new_tokens)
        self._ramps[req.request_id] = self.timeline.add(*self._plan(req))

    def _replan(self, req: Request) -> None:
        self.timeline.remove(self._ramps[req.request_id])
        self._ramps[req.request_id] = self.timeline.add(*self._plan(req))

    def stalled(self, req: Request) -> None:
        # NOTE: a ramp grows one token per step; a sequence left out of a step (the online TPOT cap,
        # a full token budget) falls behind it and would outlive its ramp, holding blocks the
        # timeline had already promised to later admissions. Re-anchored, the ramp ends when it does.
        # (No fits() check: the sequence holds its blocks whatever the timeline says; an overfull
        # future only holds admissions back.)
        if req.request_id in self._ramps:
            self._replan(req)

    def grow(self, req: Request, num_new_tokens: int) -> Grow:
        rid = req.request_id
        if req.num_computed_tokens + num_new_tokens > self.predicted_total_tokens(req):
            # Outgrew the prediction: extend to the next bucket if unreserved memory allows.
            self.timeline.remove(self._ramps[rid])
            old = req.predicted_output_tokens
            self.rebound(req)
            if not self.timeline.fits(*self._plan(req)):
                req.predicted_output_tokens = old  # the scheduler's preemption rebounds it
                self._ramps[rid] = self.timeline.add(0, 0)
                return Grow.OVERFLOW
            self._ramps[rid] = self.timeline.add(*self._plan(req))
        elif rid not in self._anchored and req.num_computed_tokens >= req.num_tokens - 1 and req.num_output_tokens:
            # NOTE: prefill may take several steps (chunking); re-anchor the ramp once decoding
            # starts so the promised trajectory tracks the real one.
            self._anchored.add(rid)
            self._replan(req)
        return super().grow(req, num_new_tokens)  # blocks on demand: OK or POOL_DRY

    def free(self, req: Request) -> None:
        super().free(req)
        ramp = self._ramps.pop(req.request_id, None)
        if ramp is not None:
            self.timeline.remove(ramp)
        self._anchored.discard(req.request_id)


class Oracle(ReservePredicted):
    name = "oracle"

    def predicted_total_tokens(self, req: Request) -> int:
        guess = req.prediction.exact_tokens
        if guess is None:
            return req.max_total_tokens
        if req.num_output_tokens >= guess:  # the "true" length was wrong (EOS not forced): widen
            guess = max(guess, req.predicted_output_tokens)
        return req.num_prompt_tokens + min(guess, req.sampling.max_tokens)


POLICIES: dict[str, type[AllocationPolicy]] = {
    cls.name: cls for cls in (ReserveMax, Paged, ReservePredicted, Oracle)
}


def make_policy(name: str, pool: KVPool, buckets: LengthBuckets, max_seq_tokens: int = 4096) -> AllocationPolicy:
    try:
        return POLICIES[name](pool, buckets, max_seq_tokens)
    except KeyError:
        raise ValueError(f"unknown allocation policy {name!r}; choose one of {sorted(POLICIES)}") from None
