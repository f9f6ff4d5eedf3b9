"""LLMEngine on the real model: the full engine (scheduler, policies, detokenizer) against HF generate."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from app.config import EngineConfig
from app.engine.async_engine import AsyncLLMEngine
from app.engine.engine import LLMEngine
from app.engine.request import EngineRequest, Prediction, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.model

NEW = 20
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers."]


@pytest.fixture(scope="module")
def engine_parts():
    config = EngineConfig(kv_cache_tokens=160, block_size_tokens=16, max_model_len_tokens=160, dtype="float32",
                          default_max_tokens=NEW, max_num_batched_tokens=24, allocation="paged", scheduler="fcfs")
    engine = LLMEngine.from_config(config)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS]
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        out = hf_model.generate(ids, max_new_tokens=NEW, do_sample=False)
        expected.append(out[0, ids.shape[1]:].tolist())  # up to and including EOS
    return config, engine.runner, prompts, expected


def run(config, runner, prompts, predicted):
    engine = LLMEngine(config, runner, config.kv_pool_blocks(1), tokenizer=runner.tokenizer)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(prompt=p, sampling=SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
                                         request_id=f"{config.allocation}-{i}", prediction=Prediction(bucket=0, bound_tokens=predicted)))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.pool.num_used_blocks == 0
    return [tokens[f"{config.allocation}-{i}"] for i in range(len(prompts))], engine.stats()


@pytest.mark.parametrize("allocation, predicted", [("paged", NEW), ("reserve_predicted", 2), ("reserve_max", NEW)])
def test_engine_greedy_equals_generate_under_preemption(engine_parts, allocation, predicted):
    config, runner, prompts, expected = engine_parts
    config = config.model_copy(update={"allocation": allocation})
    got, stats = run(config, runner, prompts, predicted)  # EOS ignored: keeps the memory pressure
    assert [g[: len(e)] for g, e in zip(got, expected)] == expected
    if allocation != "reserve_max":
        # 160 KV tokens for three ~50-token prompts growing by 20: someone must be recomputed,
        # and recompute must not change a single token.
        assert stats.preemptions > 0 and stats.recomputed_tokens > 0


def test_async_stream_text_matches_tokens_and_stop_string(engine_parts):
    config, runner, prompts, expected = engine_parts
    text = runner.tokenizer.decode(expected[1], skip_special_tokens=True)
    stop = text.split()[2]  # a word inside the greedy answer
    engine = LLMEngine(config, runner, config.kv_pool_blocks(1), tokenizer=runner.tokenizer)
    aengine = AsyncLLMEngine(engine)

    async def go():
        return [o async for o in aengine.generate(EngineRequest(
            prompt=prompts[1], sampling=SamplingParams(max_tokens=NEW, temperature=0.0, stop=(stop,)),
            prediction=Prediction(bucket=0, bound_tokens=NEW)))]

    try:
        outs = asyncio.run(go())
    finally:
        aengine.close()  # the runner is shared with the other tests
    streamed = "".join(o.text_delta for o in outs)
    assert streamed == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop"


def test_final_only_text_equals_the_streamed_text(engine_parts):
    """``stream_text=False`` (batch rows): no text until the request finishes, then all of it,
    the same text as the deltas a streaming client joins, through preemption and recompute. Each
    request's text is checked against its own tokens: the two requests of a prompt run in other
    batches, and past EOS (ignored here) float32's summation order may break a near-tie."""
    config, runner, prompts, _ = engine_parts
    sampling = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    texts: dict[str, list[str]] = {}
    tokens: dict[str, list[int]] = {}
    engine = LLMEngine(config, runner, config.kv_pool_blocks(1), tokenizer=runner.tokenizer)
    for i, p in enumerate(prompts):  # 160 KV tokens for six sequences: preemptions happen
        for stream in (True, False):
            engine.add_request(EngineRequest(prompt=p, sampling=sampling, request_id=f"{i}-{stream}",
                                             prediction=Prediction(bucket=0, bound_tokens=2), stream_text=stream))
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished or out.text_delta == "" or out.request_id.endswith("True")
            texts.setdefault(out.request_id, []).append(out.text_delta)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats().preemptions > 0
    for i in range(len(prompts)):
        final, streamed = texts[f"{i}-False"], texts[f"{i}-True"]
        whole = {rid: runner.tokenizer.decode(tokens[f"{i}-{rid}"], skip_special_tokens=True) for rid in (True, False)}
        assert final[:-1] == [""] * (NEW - 1) and final[-1] == whole[False] != ""
        assert "".join(streamed) == whole[True]


def test_an_answer_resumed_from_its_tokens_goes_on_exactly(engine_parts):
    """What the ingress does when a replica is lost mid-answer: another engine gets the prompt plus the
    tokens so far, recomputes them and continues: the same greedy tokens, the text the client has not
    seen yet (here: what the first replica held back for a stop string), counts including the resumed."""
    config, runner, prompts, _ = engine_parts
    tok = runner.tokenizer
    ids = tok.encode(prompts[1], add_special_tokens=False)
    sampling = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(config, runner, config.kv_pool_blocks(1), tokenizer=runner.tokenizer)
    engine.add_request(EngineRequest(prompt_token_ids=ids, sampling=sampling, request_id="whole",
                                     prediction=Prediction(bucket=0, bound_tokens=NEW)))
    whole = []
    while engine.has_unfinished_requests():
        whole += engine.step()
    full = [t for o in whole for t in o.new_token_ids]
    text = "".join(o.text_delta for o in whole)
    assert len(full) == NEW and text == tok.decode(full, skip_special_tokens=True)
    done = 8
    seen = len(tok.decode(full[:done], skip_special_tokens=True)) - 3  # the first replica held 3 chars back
    req = engine.add_request(EngineRequest(prompt_token_ids=ids, sampling=sampling, request_id="resumed",
                                           prediction=Prediction(bucket=0, bound_tokens=4),
                                           resume_output_token_ids=full[:done], resume_emitted_chars=seen))
    assert req.predicted_output_tokens == done + 1  # never below what is already there
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == full[done:]
    assert "".join(o.text_delta for o in outs) == text[seen:]
    assert outs[-1].num_output_tokens == NEW and outs[-1].finish_reason == "length"
    with pytest.raises(Exception, match="nothing left"):
        engine.add_request(EngineRequest(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=4),
                                         prediction=Prediction(bucket=0, bound_tokens=4), resume_output_token_ids=full[:4]))


def test_generate_cli_streams_an_answer():
    proc = subprocess.run([sys.executable, "-m", "foreserve.cli.main", "generate", "What is 2+2?", "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
