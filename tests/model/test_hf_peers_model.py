"""The transformers peer baselines on the real SmolLM2: exact useful-token counts, the row contract,
preemption in a tight KV budget (the batching rules without a model: tests/unit/test_hf_peers.py)."""

from __future__ import annotations

import os

import pytest

ROW_KEYS = {
    "policy", "scheduler", "wall_s", "output_tokens", "output_tokens_per_s", "requests_per_s",
    "mean_running_batch", "peak_kv_used_tokens", "preemptions", "recomputed_tokens",
}
QUESTIONS = [("Hi!", 5), ("Say yes.", 3), ("Name two colours.", 16), ("What is 2+2? Answer briefly.", 40)]


@pytest.fixture(scope="module")
def peer_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from loadtests.bench.hf_peers import load_peer_model

    return load_peer_model()


@pytest.fixture(scope="module")
def requests_(peer_model):
    _, tok = peer_model
    return [
        {
            "prompt": tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            "output_tokens": n,
        }
        for q, n in QUESTIONS
    ]


@pytest.mark.model
@pytest.mark.parametrize("peer", ["hf_static", "hf_continuous"])
def test_peer_counts_useful_tokens(peer, peer_model, requests_):
    from loadtests.bench.hf_peers import run_hf_continuous, run_hf_static

    model, tok = peer_model
    fn = run_hf_static if peer == "hf_static" else run_hf_continuous
    row = fn(model, tok, requests_, kv_tokens=512, max_tokens=16)
    assert ROW_KEYS <= set(row)
    assert row["policy"] == peer
    assert row["scheduler"] == ("static" if peer == "hf_static" else "hf_paged")
    assert row["output_tokens"] == sum(min(n, 16) for _, n in QUESTIONS)
    assert row["output_tokens_per_s"] > 0 and row["wall_s"] > 0
    assert row["peak_kv_used_tokens"] > 0
    if peer == "hf_continuous":
        assert row["peak_kv_used_tokens"] <= 512  # the paged cache holds exactly the budget


@pytest.mark.model
def test_continuous_preempts_in_a_tight_budget(peer_model, requests_):
    from loadtests.bench.hf_peers import run_hf_continuous

    model, tok = peer_model
    row = run_hf_continuous(model, tok, requests_, kv_tokens=128, max_tokens=16)
    assert row["output_tokens"] == sum(min(n, 16) for _, n in QUESTIONS)  # recomputation not counted
    assert row["peak_kv_used_tokens"] <= 128
    assert row["preemptions"] >= 1 and row["recomputed_tokens"] > 0
