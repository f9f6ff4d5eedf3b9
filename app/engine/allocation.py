"""KV allocation policies: "does this fit / give me blocks / can it grow".

Every policy counts blocks of the replica's one `KVPool`, so what it accounts is what is
physically held. The scheduler decides order and victims; it never sees block internals.

- ``reserve_max``: reserve prompt + max_tokens at admission (FasterTransformer/ORCA baseline).
- ``paged``: allocate on demand; when the pool runs dry the scheduler preempts (vLLM).
- ``reserve_predicted``: reserve prompt + predicted bound; on overflow grow into free blocks,
  else the sequence is preempted and re-admitted with the next bucket's bound (S3).
- ``oracle``: reserve prompt + the true output length (benchmarks: the limit of prediction).
"""

from __future__ import annotations

import enum

from app.engine.kv_pool import KVPool
from app.engine.request import Request
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

    def __init__(self, pool: KVPool, buckets: LengthBuckets) -> None:
        self.pool = pool
        self.buckets = buckets
        self._tables: dict[str, list[int]] = {}

    # -- what a policy decides -------------------------------------------------------------
    def reservation_tokens(self, req: Request) -> int:
        """Tokens to hold for ``req`` at admission (beyond what it is about to compute)."""
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

    def held_tokens(self, req: Request) -> int:
        return len(self._tables.get(req.request_id, ())) * self.pool.block_size_tokens


class ReserveMax(AllocationPolicy):
    name = "reserve_max"

    def reservation_tokens(self, req: Request) -> int:
        return req.max_total_tokens


class Paged(AllocationPolicy):
    name = "paged"
    reserves = False

    def __init__(self, pool: KVPool, buckets: LengthBuckets) -> None:
        super().__init__(pool, buckets)
        # NOTE: vLLM keeps ~1% of the pool free at admission so that freshly admitted
        # sequences can decode a few steps before the pool runs dry and forces preemption.
        self.watermark_blocks = max(1, pool.num_blocks // 100)

    def reservation_tokens(self, req: Request) -> int:
        return 0


class ReservePredicted(AllocationPolicy):
    name = "reserve_predicted"

    def reservation_tokens(self, req: Request) -> int:
        guess = req.predicted_output_tokens or req.sampling.max_tokens
        return req.num_prompt_tokens + max(guess, req.num_output_tokens + 1)

    def rebound(self, req: Request) -> None:
        bound = self.buckets.next_bound_tokens(req.num_output_tokens)
        req.predicted_output_tokens = min(max(bound, req.num_output_tokens + 1), req.sampling.max_tokens)


class Oracle(ReservePredicted):
    name = "oracle"

    def reservation_tokens(self, req: Request) -> int:
        if req.true_output_tokens is None:
            return req.max_total_tokens
        return req.num_prompt_tokens + max(req.true_output_tokens, req.num_output_tokens + 1)


POLICIES: dict[str, type[AllocationPolicy]] = {
    cls.name: cls for cls in (ReserveMax, Paged, ReservePredicted, Oracle)
}


def make_policy(name: str, pool: KVPool, buckets: LengthBuckets) -> AllocationPolicy:
    try:
        return POLICIES[name](pool, buckets)
    except KeyError:
        raise ValueError(f"unknown allocation policy {name!r}; choose one of {sorted(POLICIES)}") from None
