"""The frozen-feature probe behind the README's "what other encoders know" table."""

from __future__ import annotations

import numpy as np

from scripts.predictor_probe import _length_sorted_batches, crossfit, probe
from predictor.buckets import LengthBuckets


def test_batches_cover_every_prompt_once_within_the_token_budget():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, 300, size=500)]
    batches = _length_sorted_batches(lengths, budget_tokens=1024, max_batch=16)
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(500))
    for batch in batches:
        assert len(batch) <= 16
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 1024


def test_probe_finds_a_linear_signal_and_not_noise():
    rng = np.random.default_rng(0)
    buckets = LengthBuckets(max_tokens=1024, num_buckets=10)
    tokens = rng.integers(1, 1400, size=1200)  # past max_tokens counts as max_tokens
    signal = np.log1p(np.minimum(tokens, 1024))[:, None] * rng.normal(size=(1, 8)) + 0.05 * rng.normal(size=(1200, 8))
    noise = rng.normal(size=(1200, 8))
    good = probe(signal[:900], tokens[:900], signal[900:], tokens[900:], buckets)
    bad = probe(noise[:900], tokens[:900], noise[900:], tokens[900:], buckets)
    assert good["kendall_tau"] > 0.9 and good["within1_bucket_acc"] > 0.65
    assert abs(bad["kendall_tau"]) < 0.15 and bad["within1_bucket_acc"] < 0.5
    assert good["dim"] == 8


def test_crossfit_scores_every_prompt_out_of_fold():
    """A feature that is the answer for the prompt itself but useless across prompts (a row id)
    must score nothing: out-of-fold predictions never see their own label."""
    rng = np.random.default_rng(1)
    buckets = LengthBuckets(max_tokens=1024, num_buckets=10)
    tokens = rng.integers(1, 1024, size=400)
    row_id = np.eye(400)  # memorisable per row, no signal across rows
    signal = np.log1p(tokens)[:, None] + 0.01 * rng.normal(size=(400, 1))
    assert abs(crossfit(row_id, tokens, buckets)["kendall_tau"]) < 0.15
    assert crossfit(signal, tokens, buckets)["kendall_tau"] > 0.9
