"""The replica's preallocated KV block pool: the one source of truth for KV memory.

The pool hands out block ids; the runner owns the tensors, shaped ``[num_blocks, block_size, ...]``
from this pool's ``num_blocks``. Allocation policies count blocks here and nowhere else, so what
they account is exactly what is physically held.
"""

from __future__ import annotations

import math


class PoolExhaustedError(RuntimeError):
    pass


class KVPool:
    def __init__(self, num_blocks: int, block_size_tokens: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV pool needs at least one block, got num_blocks={num_blocks}")
        if block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be >= 1, got {block_size_tokens}")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        # NOTE: a stack, so recently freed (cache-warm) blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.peak_used_blocks = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_tokens(self) -> int:
        return self.num_used_blocks * self.block_size_tokens

    @property
    def peak_used_tokens(self) -> int:
        return self.peak_used_blocks * self.block_size_tokens

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size_tokens)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhaustedError(f"asked for {n} blocks, {len(self._free)} free")
        if n <= 0:
            return []
        blocks = self._free[-n:]
        del self._free[-n:]
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        if len(self._free) > self.num_blocks:
            raise RuntimeError("KV pool double free: more free blocks than the pool holds")

    def reset_peak(self) -> None:
        self.peak_used_blocks = self.num_used_blocks
