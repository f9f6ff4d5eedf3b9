"""The learned predictor: a trained ``LengthModel`` behind the engine's ``LengthPredictor`` interface."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from predictor.base import LengthPrediction, LengthPredictor
from predictor.model import LengthModel, ModelSpec, collate, cpu_has_fast_bf16, encode_prompts

# NOTE: inputs are padded to a multiple of this many tokens. Every distinct (batch, width) shape makes
# oneDNN and the allocator keep buffers of its own: at exact widths the predictor replica grew from
# 0.5 to 1.5 GB over 4,000 ShareGPT prompts; padded, it stays at 0.53 GB (and runs no slower).
PAD_MULTIPLE = 64


def decode(probs: np.ndarray, spec: ModelSpec, bound_quantile: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bucket probabilities -> (argmax buckets, reservation bounds in tokens, expected tokens).

    The bound is the upper edge of the first bucket where the predicted CDF reaches the quantile:
    a higher quantile reserves more and preempts less."""
    buckets = spec.buckets
    q = spec.bound_quantile if bound_quantile is None else bound_quantile
    argmax = probs.argmax(axis=1)
    bounds = np.array([buckets.upper_bound_tokens(int(b)) for b in buckets.quantile_buckets(probs, q)])
    mids = (np.arange(spec.num_buckets) + 0.5) * buckets.width_tokens
    return argmax, bounds, probs @ mids


def score_tokens(scores: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Ranking scores back in tokens: the score regresses the standardised log1p length, so this is
    a length estimate (about the median) that orders as the scores do (ties only at the clip)."""
    logs = np.asarray(scores, dtype=np.float64) * spec.score_std + spec.score_mean
    return np.clip(np.expm1(logs), 1.0, float(spec.max_tokens))


class LearnedPredictor(LengthPredictor):
    """Batched, thread-safe inference; prompts are sorted by length so padding stays small."""

    name = "learned"

    def __init__(self, model: LengthModel, tokenizer, version: str = "local", batch_size: int = 32,
                 bound_quantile: float | None = None, bf16: bool | None = None, max_batch_tokens: int = 2048) -> None:
        super().__init__(model.spec.buckets)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = model.spec
        self.version = version
        self.batch_size = batch_size
        self.bound_quantile = self.spec.bound_quantile if bound_quantile is None else bound_quantile
        self.bf16 = cpu_has_fast_bf16() if bf16 is None else bf16  # None: when the CPU has native bf16
        self.max_batch_tokens = max_batch_tokens
        self._lock = threading.Lock()

    @classmethod
    def from_dir(cls, directory: Path, version: str = "local", **kwargs) -> "LearnedPredictor":
        model, tokenizer = LengthModel.load(directory)
        return cls(model, tokenizer, version=version, **kwargs)

    def infer(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Bucket probabilities ``[n, num_buckets]`` and ranking scores ``[n]`` (higher = longer)."""
        n = len(texts)
        probs = np.zeros((n, self.spec.num_buckets), dtype=np.float32)
        scores = np.zeros(n, dtype=np.float32)
        if n == 0:
            return probs, scores
        ids = encode_prompts(self.tokenizer, [t or "" for t in texts], self.spec)
        with self._lock, torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            for idx in self._micro_batches([len(t) for t in ids]):
                input_ids, mask = collate([ids[i] for i in idx], self.tokenizer.pad_token_id, PAD_MULTIPLE)
                logits, score = self.model(input_ids, mask)
                probs[idx] = torch.softmax(logits.float(), dim=-1).numpy()
                scores[idx] = score.float().numpy()
        return probs, scores

    def _micro_batches(self, lengths: list[int]) -> list[np.ndarray]:
        """Length-sorted micro-batches of at most ``batch_size`` prompts and ``max_batch_tokens``
        padded tokens: one long prompt must not make 31 short ones pay for its padding."""
        order = np.argsort(lengths, kind="stable")
        batches, start = [], 0
        for end in range(1, len(order) + 1):
            width = lengths[order[end - 1]]
            if end - start > self.batch_size or (end - start > 1 and width * (end - start) > self.max_batch_tokens):
                batches.append(order[start : end - 1])
                start = end - 1
        batches.append(order[start:])
        return batches

    def predict(self, prompts: Sequence[str]) -> LengthPrediction:
        probs, scores = self.infer(prompts)
        argmax, bounds, expected = decode(probs, self.spec, self.bound_quantile)
        return LengthPrediction(
            buckets=[int(b) for b in argmax],
            probabilities=probs,
            bound_tokens=[int(b) for b in bounds],
            expected_tokens=[float(e) for e in expected],
            scores=[float(s) for s in scores],
            rank_tokens=[float(t) for t in score_tokens(scores, self.spec)],
        )
