"""The transformers peer baselines without a model: static batches and request normalisation
(the runs on the real SmolLM2: tests/model/test_hf_peers_model.py)."""

from __future__ import annotations

import pytest

from loadtests.bench.hf_peers import PeerRequest, normalize_requests, static_batches


def test_static_batches_reserve_max_length():
    reqs = [PeerRequest([1] * n, 4) for n in (100, 200, 300, 600, 10)]
    batches = static_batches(reqs, kv_tokens=512, max_tokens=100)
    # 200 + 300 = 500 fits, 500 + 400 does not; 700 alone exceeds the budget but a batch holds >= 1
    assert [[len(r.prompt_token_ids) for r in b] for b in batches] == [[100, 200], [300], [600], [10]]


def test_normalize_caps_and_validates():
    reqs = normalize_requests([{"prompt_token_ids": [1, 2], "output_tokens": 50}], tokenizer=None, max_tokens=16)
    assert reqs == [PeerRequest([1, 2], 16)]
    with pytest.raises(ValueError):
        normalize_requests([{"prompt_token_ids": [1], "output_tokens": 0}], tokenizer=None, max_tokens=16)
