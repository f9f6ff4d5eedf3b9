"""Tensor parallelism: DeepSpeed AutoTP over 2 rank processes gives the tp=1 greedy tokens.

SmolLM2 has 9 query heads and 3 KV heads; AutoTP splits them by whole KV-head groups
(rank 0: 6 q / 2 kv heads, rank 1: 3 q / 1 kv head), so GQA grouping stays intact.
"""

from __future__ import annotations

import os
import signal

import pytest

from app.config import EngineConfig
from app.engine.request import ScheduledChunk, SchedulerOutput
from tests.test_runner import BLOCK, GREEDY, QUESTIONS, Seq, play_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [pytest.mark.slow, pytest.mark.model]


def _prompts(tokenizer) -> list[list[int]]:
    out = []
    for q in QUESTIONS[:2]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _seqs(prompts: list[list[int]]) -> list[Seq]:
    # "b" prefills in chunks of 7 while "a" decodes
    return [Seq("a", prompts[0], GREEDY), Seq("b", prompts[1], GREEDY, chunk_tokens=7, start_step=2)]


def test_tp2_matches_tp1_and_shuts_down_cleanly():
    from app.engine.runner import HFRunner
    from app.engine.tp import TPGroupError, TPRunner, _shm_path

    import torch

    threads = torch.get_num_threads()
    config = EngineConfig(kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1)
    num_blocks = config.kv_pool_blocks(1)
    tp1 = HFRunner(config, num_blocks)
    prompts = _prompts(tp1.tokenizer)
    expected = play_engine(tp1, _seqs(prompts))
    del tp1
    torch.set_num_threads(threads)

    tp2 = TPRunner(config.model_copy(update={"tensor_parallel_size": 2}), num_blocks)
    try:
        assert [(i["num_heads"], i["num_kv_heads"]) for i in tp2.rank_info] == [(6, 2), (3, 1)]
        assert tp2.eos_token_id == 2
        assert play_engine(tp2, _seqs(prompts)) == expected
        # a bad chunk fails on every rank alike: the error comes back and the group stays usable
        bad = ScheduledChunk("x", list(range(10, 40)), 0, [0], True, GREEDY, 0)
        with pytest.raises(ValueError, match="exceed"):
            tp2.execute(SchedulerOutput([bad]))
        assert play_engine(tp2, _seqs(prompts)[:1])["a"] == expected["a"]
        # a rank that dies takes the group down cleanly, with a clear error
        os.kill(tp2._procs[1].pid, signal.SIGKILL)
        tp2._procs[1].join(10)
        chunk = ScheduledChunk("y", prompts[0], 0, list(range(8)), True, GREEDY, 0)
        with pytest.raises(TPGroupError, match="rank 1"):
            tp2.execute(SchedulerOutput([chunk]))
        with pytest.raises(TPGroupError):
            tp2.execute(SchedulerOutput([chunk]))
    finally:
        tp2.shutdown()
    tp2.shutdown()  # idempotent
    for p in tp2._procs:
        assert not p.is_alive()
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)
    assert not any(os.path.exists(_shm_path(tp2.master_port, r)) for r in range(2))
