"""The stand-in engine that drives a model runner step by step (tests/model/test_runner*.py,
tests/e2e/test_tp.py): sequences, their chunks, and a loop that samples until EOS or a limit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from app.config import EngineConfig
from app.engine.kv.pool import KVPool
from app.engine.outputs import ScheduledChunk, SchedulerOutput
from app.engine.request import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 16
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering.",
]


@contextmanager
def one_thread_runner(dtype: str) -> Iterator:
    """An HFRunner on a 2,048-token pool with one intra-op thread; torch's thread count (process-wide)
    is restored after. These batches are tiny, and a second OpenMP thread stalls badly when other
    processes share the cores."""
    from app.engine.model.hf_runner import HFRunner

    threads = torch.get_num_threads()
    config = EngineConfig(kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1, dtype=dtype)
    runner = HFRunner(config, config.kv_pool_blocks(1))
    try:
        yield runner
    finally:
        runner.shutdown()
        torch.set_num_threads(threads)


NEAR_TIE = 0.5  # logits: two tokens this close may change places when every activation is rounded to bfloat16


def turns_only_at_near_ties(model, prompt: list[int], got: list[int], ref: list[int]) -> bool:
    """Whether ``got`` equals ``ref`` up to the first token where they part, and there the token
    ``got`` took scores within ``NEAR_TIE`` of ``ref``'s under ``model`` (float32), given the same prefix."""
    k = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if k is None:
        return len(got) == len(ref)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:k]])).logits[0, -1]
    return abs(float(logits[ref[k]] - logits[got[k]])) < NEAR_TIE


def generate_greedy(model, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of ``NEW_TOKENS`` after each prompt: the reference answers."""
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=eos)
            refs.append(gen[0, len(ids):].tolist())
    return refs


def chat_prompts(tokenizer, questions: list[str] = QUESTIONS) -> list[list[int]]:
    """Each question as the model's chat template renders a user turn, as token ids."""
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@dataclass
class Seq:
    """One sequence as the stand-in engine sees it."""

    rid: str
    prompt: list[int]
    sampling: SamplingParams
    chunk_tokens: int = 10_000  # prefill chunk size
    start_step: int = 0  # step at which it is admitted
    preempt_step: int | None = None  # step at which it loses its blocks and recomputes (prompt, then its answer so far)
    blocks: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    computed: int = 0
    done: bool = False

    def next_chunk(self) -> ScheduledChunk:
        tokens = self.prompt + self.out
        if self.computed < len(self.prompt):
            ids = self.prompt[self.computed : self.computed + self.chunk_tokens]
        else:
            ids = tokens[self.computed :]
        sample = self.computed + len(ids) == len(tokens)
        return ScheduledChunk(self.rid, ids, self.computed, self.blocks, sample, self.sampling, len(self.out))


def play_engine(runner, seqs: list[Seq], max_new: int = NEW_TOKENS) -> dict[str, list[int]]:
    """Schedule chunks step by step, append sampled tokens, stop at EOS or ``max_new``."""
    pool = KVPool(runner.num_blocks, BLOCK)
    finished: list[str] = []
    step = 0
    while not all(s.done for s in seqs):
        live = [s for s in seqs if not s.done and s.start_step <= step]
        for s in live:
            if s.preempt_step == step and s.blocks:
                pool.free(s.blocks)
                s.blocks, s.computed = [], 0
        for s in live:
            if not s.blocks:
                s.blocks = pool.allocate(pool.blocks_for(len(s.prompt) + max_new))
        chunks = [s.next_chunk() for s in live]
        result = runner.execute(SchedulerOutput(chunks, finished_request_ids=finished))
        finished = []
        assert set(result.sampled_token_ids) == {c.request_id for c in chunks if c.sample}
        for s, c in zip(live, chunks):
            s.computed += len(c.token_ids)
            if c.sample:
                tok = result.sampled_token_ids[s.rid]
                s.out.append(tok)
                if tok == runner.eos_token_id or tok in runner.eos_token_ids or len(s.out) == max_new:
                    s.done = True
                    pool.free(s.blocks)
                    finished.append(s.rid)
        step += 1
    assert pool.num_free_blocks == pool.num_blocks
    return {s.rid: s.out for s in seqs}
