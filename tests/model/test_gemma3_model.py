"""Gemma 3 270M with its real weights (the packaged GGUF, de-quantized into a folder by
``app.prepare.model``) against transformers: 64 greedy tokens for 8 prompts in float32, in one mixed
batch with chunked prefill; four prompts reach past the 512-token sliding window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.config import EngineConfig
from app.engine.request import SamplingParams
from tests.runner_helpers import BLOCK, Seq, play_engine

pytestmark = pytest.mark.model
NEW = 64
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    from app.prepare.model import ensure_model

    return ensure_model(name="gemma-3-270m")


def prompts(tokenizer) -> list[list[int]]:
    """Four short questions and four long passages of foreserve's own docs (600-900 tokens)."""
    short = ["The capital of France is", "Here is a haiku about the sea:\n", "def fibonacci(n):",
             "The three primary colors are"]
    texts = [(DOCS / name).read_text() for name in ("design.md", "engine.md", "serving.md", "chaos.md")]
    out = [tokenizer.encode(t) for t in short]
    for n, text in zip((600, 700, 800, 900), texts):
        out.append(tokenizer.encode(text)[:n])
    return out


def test_gemma3_270m_greedy_equals_transformers(gemma_dir):
    from transformers import AutoModelForCausalLM

    from app.engine.model.hf_runner import HFRunner

    config = EngineConfig(model=str(gemma_dir), dtype="float32", kv_cache_tokens=8192, block_size_tokens=BLOCK,
                          torch_threads=2, max_num_batched_tokens=256)
    runner = HFRunner(config, config.kv_pool_blocks(1))
    assert runner.arch.layer_window.count(512) == 15 and runner.arch.vocab_size == 262144
    ids = prompts(runner.tokenizer)
    assert sum(len(p) > 512 for p in ids) == 4
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW)
    seqs = [Seq(f"s{i}", p, greedy, chunk_tokens=(97, 256)[i % 2], start_step=i) for i, p in enumerate(ids)]
    got = play_engine(runner, seqs, max_new=NEW)
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for s in seqs:
            x = torch.tensor([s.prompt])
            ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)[0, len(s.prompt):].tolist()
            ends = [k for k, t in enumerate(ref) if t in runner.eos_token_ids]
            ref = ref[: ends[0] + 1] if ends else ref
            assert got[s.rid] == ref, (s.rid, len(s.prompt))
