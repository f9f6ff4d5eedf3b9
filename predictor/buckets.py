"""Equal-width output-length buckets (S3: max_tokens / num_buckets each)."""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class LengthBuckets(BaseModel):
    """Bucket ``i`` holds lengths in ``(i*w, (i+1)*w]`` with ``w = max_tokens / num_buckets``;
    lengths past ``max_tokens`` fall in the last bucket."""

    model_config = ConfigDict(frozen=True)

    max_tokens: int = Field(1024, ge=1, description="Length covered by the buckets (the system's max_tokens).")
    num_buckets: int = Field(10, ge=1, description="Number of equal-width buckets.")

    @property
    def width_tokens(self) -> float:
        return self.max_tokens / self.num_buckets

    def bucket_of(self, output_tokens: int) -> int:
        if output_tokens <= 0:
            return 0
        # NOTE: integers, not n / width: float division put some edges one bucket off (3000 / 35)
        return min((output_tokens * self.num_buckets - 1) // self.max_tokens, self.num_buckets - 1)

    def upper_bound_tokens(self, bucket: int) -> int:
        """Largest length in ``bucket`` (an integer, so ``upper_bound(bucket_of(n)) >= n``)."""
        bucket = min(max(bucket, 0), self.num_buckets - 1)
        return (bucket + 1) * self.max_tokens // self.num_buckets

    def quantile_buckets(self, probs, quantile: float) -> np.ndarray:
        """Per row of ``probs`` (``[n, num_buckets]`` or one row): the first bucket where the
        cumulative probability reaches ``quantile``."""
        cdf = np.cumsum(np.asarray(probs, dtype=np.float64).reshape(-1, self.num_buckets), axis=1)
        return np.minimum((cdf < quantile - 1e-6).sum(axis=1), self.num_buckets - 1)

    def quantile_bound_tokens(self, probs, quantile: float) -> int:
        """The reservation bound at ``quantile`` of one predicted length distribution over these
        buckets: the upper edge of its quantile bucket (a higher quantile reserves more and
        preempts less)."""
        return self.upper_bound_tokens(int(self.quantile_buckets(probs, quantile)[0]))

    def next_bound_tokens(self, generated_tokens: int) -> int:
        """The bound to re-admit with once ``generated_tokens`` outgrew a reservation: the upper
        edge of the next bucket. Past the last bucket it grows by one bucket width."""
        bucket = self.bucket_of(generated_tokens + 1)
        bound = self.upper_bound_tokens(bucket)
        if bound <= generated_tokens:
            bound = generated_tokens + math.ceil(self.width_tokens)
        return bound
