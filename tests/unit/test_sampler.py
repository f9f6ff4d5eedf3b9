"""The Sampler alone (no model): greedy rows, top-k/top-p support, extreme values, seeds, the
top-k/top-p filter among the largest logits against a full sort, per-row independence, NaN."""

from __future__ import annotations

import pytest
import torch

from app.engine.request import SamplingParams
from app.engine.model.sampler import Sampler


def _params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def test_sampler_greedy_rows_are_argmax():
    logits = torch.randn(4, 50)
    s = Sampler()
    toks = s.sample(logits, ["a", "b", "c", "d"], [_params(temperature=0.0)] * 4, [0] * 4)
    assert toks == logits.argmax(-1).tolist()


def test_sampler_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]] * 2)
    s = Sampler()
    seen_k, seen_p = set(), set()
    for n in range(200):
        tk, tp = s.sample(logits, ["k", "p"], [_params(top_k=2, seed=1), _params(top_p=0.5, seed=2)], [n, n])
        seen_k.add(tk)
        seen_p.add(tp)
    assert seen_k == {0, 1}
    assert seen_p == {0}  # token 0 alone holds ~0.71 of the mass


def test_sampler_survives_extreme_but_valid_values():
    """Values the API accepts must not crash the engine loop (one request would fail them all)."""
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]])
    s = Sampler()
    assert _params(temperature=1e-50).greedy
    assert s.sample(logits, ["t"], [_params(temperature=1e-50, seed=1)], [0]) == [0]
    assert s.sample(logits, ["p"], [_params(top_p=1e-50, seed=1)], [0]) == [0]  # top_p 0 in float32
    for seed in (2**63 - 1, -(2**63)):
        assert s.sample(logits, [f"s{seed}"], [_params(seed=seed)], [0])[0] in range(5)
    with pytest.raises(ValueError, match="less than or equal"):
        _params(seed=2**64)


def test_sampler_seed_reproducible_and_drop():
    logits = torch.zeros(1, 1000)
    p = _params(temperature=1.0, seed=7)
    a, b = Sampler(), Sampler()
    seq_a = [a.sample(logits, ["r"], [p], [n])[0] for n in range(20)]
    seq_b = [b.sample(logits, ["r"], [p], [n])[0] for n in range(20)]
    assert seq_a == seq_b and len(set(seq_a)) > 10
    a.drop(["r"])
    assert [a.sample(logits, ["r"], [p], [n])[0] for n in range(20)] == seq_a


def _reference_draws(row: torch.Tensor, top_k: int, top_p: float, uniform: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
    """The textbook filter on one row (full sort, top-k, then top-p), drawn by inverse CDF; and
    the tokens it keeps."""
    values, order = row.sort(descending=True)
    if top_k > 0:
        values = values[:top_k]
    probs = torch.softmax(values.double(), dim=0)
    keep = int(((probs.cumsum(0) - probs) < top_p).sum().clamp_min(1))
    cdf = probs[:keep].cumsum(0) / probs[:keep].sum()
    return order[torch.searchsorted(cdf, uniform.double(), right=True).clamp_max(keep - 1)], set(order[:keep].tolist())


def test_sampler_candidate_filter_draws_as_the_full_sort():
    """Top-k / top-p among the largest logits, with the full sort where they do not suffice, must
    draw what filtering the whole sorted vocabulary draws, for every uniform value."""
    from app.engine.model.sampler import CANDIDATES

    vocab = 4 * CANDIDATES + 13
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    peaked = (-3.0 * ranks.log())[torch.randperm(vocab, generator=g)]  # top-p mass within the candidates
    flat = torch.randn(vocab, generator=g) * 0.1  # it is not: the full-sort fallback
    zipf = (-ranks.log())[torch.randperm(vocab, generator=g)]  # a top-k past the candidates moves its top-p cut
    cases = [(peaked, 0, 0.9), (flat, 0, 0.9), (peaked, 50, 0.95), (flat, 3 * CANDIDATES, 1.0),
             (zipf, 3 * CANDIDATES, 0.5), (flat, 7, 1.0), (peaked, 0, 1.0), (flat, 0, 1e-50)]
    uniform = (torch.arange(997, dtype=torch.float32) + 0.5) / 997
    n = len(uniform)
    logits = torch.stack([row for row, _, _ in cases for _ in range(n)])
    picks = Sampler._sample_filtered(logits, [k for _, k, _ in cases for _ in range(n)],
                                     [p for _, _, p in cases for _ in range(n)], uniform.repeat(len(cases)))
    for c, (row, k, p) in enumerate(cases):
        (want, kept), got = _reference_draws(row, k, p, uniform), picks[c * n : (c + 1) * n]
        assert set(got.tolist()) <= kept, c
        assert (got == want).float().mean() >= 0.995, c  # a draw on a float-rounded edge may differ


def test_sampler_row_draws_do_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 1000, generator=g) * 2
    plain, nucleus = _params(temperature=1.0, seed=7), _params(temperature=1.0, top_p=0.5, seed=8)
    alone = [Sampler().sample(logits[:1], ["a"], [plain], [n])[0] for n in range(30)]
    beside = [Sampler().sample(logits[:2], ["a", "b"], [plain, nucleus], [n, n])[0] for n in range(30)]
    assert alone == beside and len(set(alone)) > 5
    alone = [Sampler().sample(logits[1:2], ["b"], [nucleus], [n])[0] for n in range(30)]
    assert alone == [Sampler().sample(logits[:2], ["a", "b"], [plain, nucleus], [n, n])[1] for n in range(30)]


def test_a_poisoned_row_fails_alone():
    """A row with NaN, +inf or only -inf logits gives None (its request fails); the rows beside it,
    greedy or drawn, get the tokens they get alone."""
    good = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 3.0]])
    poisons = ([1.0, float("nan"), 0.0], [float("inf"), 0.0, 0.0], [float("-inf")] * 3)
    for poison in poisons:
        logits = torch.cat([good[:1], torch.tensor([poison]), good[1:]])
        for params in (_params(), _params(seed=1), _params(top_p=0.5, seed=1), _params(top_k=2, seed=1)):
            out = Sampler().sample(logits, ["a", "bad", "c"], [params] * 3, [0] * 3)
            alone = Sampler().sample(good, ["a", "c"], [params] * 2, [0] * 2)
            assert out == [alone[0], None, alone[1]], (poison, params)
