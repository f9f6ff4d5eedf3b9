"""Predictor quality: the numbers MLflow logs and the promotion gate compares."""

from __future__ import annotations

import numpy as np
from scipy.stats import kendalltau

from predictor.buckets import LengthBuckets

METRICS = ("exact_bucket_acc", "within1_bucket_acc", "kendall_tau", "mae_tokens", "under_prediction_rate")


def score_predictions(
    true_tokens: np.ndarray,
    pred_buckets: np.ndarray,
    bound_tokens: np.ndarray,
    expected_tokens: np.ndarray,
    scores: np.ndarray,
    buckets: LengthBuckets,
) -> dict[str, float]:
    """``true_tokens`` are real output lengths; lengths past ``buckets.max_tokens`` count as
    ``max_tokens`` (the engine never generates more). Kendall tau (tau-b, ties allowed) compares
    the ranking ``scores`` with the true lengths."""
    true_tokens = np.asarray(true_tokens, dtype=np.int64)
    if true_tokens.size == 0:
        raise ValueError("no examples to score")
    capped = np.minimum(true_tokens, buckets.max_tokens)
    true_buckets = np.array([buckets.bucket_of(int(t)) for t in capped])
    pred_buckets = np.asarray(pred_buckets)
    tau = kendalltau(np.asarray(scores, dtype=np.float64), capped).statistic if true_tokens.size > 1 else 0.0
    return {
        "n": int(true_tokens.size),
        "exact_bucket_acc": float(np.mean(pred_buckets == true_buckets)),
        "within1_bucket_acc": float(np.mean(np.abs(pred_buckets - true_buckets) <= 1)),
        "kendall_tau": float(0.0 if np.isnan(tau) else tau),
        "mae_tokens": float(np.mean(np.abs(np.asarray(expected_tokens, dtype=np.float64) - capped))),
        "under_prediction_rate": float(np.mean(np.asarray(bound_tokens) < capped)),
    }
