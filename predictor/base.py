"""The predictor interface the engine depends on, and the two prediction-free implementations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from predictor.buckets import LengthBuckets

# MaxPredictor's bound: "no prediction, reserve the request's whole max_tokens". The engine clamps
# every bound to the request's max_tokens, so this reserves a 2,000-token request's 2,000 tokens
# where the last bucket's edge (the default max_tokens) would have reserved only 1,024.
NO_BOUND = 2**31 - 1

@dataclass(slots=True)
class LengthPrediction:
    """Per prompt: the predicted bucket, the bucket probabilities and the reservation bound."""

    buckets: list[int]
    probabilities: np.ndarray  # [n_prompts, num_buckets]
    bound_tokens: list[int]  # what the engine reserves for the output (a guess, not a length)
    expected_tokens: list[float] | None = None  # the predicted mean length, when the predictor has one
    scores: list[float] | None = None  # a ranking score (higher = longer), when the predictor has one
    rank_tokens: list[float] | None = None  # the ranking score in tokens: what the online scheduler orders by


class LengthPredictor:
    """``predict(prompts) -> LengthPrediction``. Implementations must be safe to call in batches."""

    name: str = "base"
    version: str = "0"

    def __init__(self, buckets: LengthBuckets | None = None) -> None:
        self.buckets = buckets or LengthBuckets()

    def predict(self, prompts: Sequence[str]) -> LengthPrediction:  # pragma: no cover
        raise NotImplementedError

    def _from_buckets(self, buckets: list[int]) -> LengthPrediction:
        probs = np.zeros((len(buckets), self.buckets.num_buckets), dtype=np.float32)
        probs[np.arange(len(buckets)), buckets] = 1.0
        return LengthPrediction(buckets, probs, [self.buckets.upper_bound_tokens(b) for b in buckets])


class MaxPredictor(LengthPredictor):
    """No prediction: every prompt gets the last bucket (reserve for max_tokens). As the fallback for
    a predictor that could not be loaded, ``unavailable`` says why (None when max was asked for)."""

    name = "max"
    unavailable: str | None = None

    def predict(self, prompts: Sequence[str]) -> LengthPrediction:
        pred = self._from_buckets([self.buckets.num_buckets - 1] * len(prompts))
        pred.bound_tokens = [NO_BOUND] * len(prompts)
        return pred


class OraclePredictor(LengthPredictor):
    """The true length's bucket, looked up by prompt text (benchmarks replaying a trace).

    ``true_output_tokens``: ``(prompt, true length)`` pairs in trace order (or a mapping). A trace
    may repeat a prompt with other answers (ShareGPT does: 18 texts among the first 2,000
    validation records); within one ``predict`` call the n-th occurrence of a prompt gets the n-th
    recorded length, so a whole trace asked in order gets every request's own length."""

    name = "oracle"

    def __init__(self, true_output_tokens: Mapping[str, int] | Sequence[tuple[str, int]],
                 buckets: LengthBuckets | None = None) -> None:
        super().__init__(buckets)
        pairs = true_output_tokens.items() if isinstance(true_output_tokens, Mapping) else true_output_tokens
        self.true_output_tokens: dict[str, list[int]] = {}
        for prompt, tokens in pairs:
            self.true_output_tokens.setdefault(prompt, []).append(int(tokens))

    def predict(self, prompts: Sequence[str]) -> LengthPrediction:
        missing = [p for p in prompts if p not in self.true_output_tokens]
        if missing:
            raise KeyError(f"oracle predictor has no true length for {len(missing)} prompt(s)")
        seen: dict[str, int] = {}
        true = []
        for p in prompts:
            lengths = self.true_output_tokens[p]
            n = seen.get(p, 0)
            seen[p] = n + 1
            true.append(lengths[min(n, len(lengths) - 1)])
        pred = self._from_buckets([self.buckets.bucket_of(t) for t in true])
        pred.rank_tokens = [float(t) for t in true]  # NOTE: the exact length: the ordering's ceiling too
        return pred
