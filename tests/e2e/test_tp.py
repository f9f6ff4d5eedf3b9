"""Tensor parallelism: DeepSpeed AutoTP over 2 rank processes gives the tp=1 greedy tokens.

SmolLM2 has 9 query heads and 3 KV heads; AutoTP splits them by whole KV-head groups
(rank 0: 6 q / 2 kv heads, rank 1: 3 q / 1 kv head), so GQA grouping stays intact.
"""

from __future__ import annotations

import glob

import os
import signal

import pytest

from app.config import EngineConfig
from app.engine.outputs import ScheduledChunk, SchedulerOutput
from tests.runner_helpers import BLOCK, GREEDY, QUESTIONS, Seq, chat_prompts, play_engine, turns_only_at_near_ties

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.deepspeed]


def _prompts(tokenizer) -> list[list[int]]:
    return chat_prompts(tokenizer, QUESTIONS[:2])


def _seqs(prompts: list[list[int]]) -> list[Seq]:
    # "b" prefills in chunks of 7 while "a" decodes
    return [Seq("a", prompts[0], GREEDY), Seq("b", prompts[1], GREEDY, chunk_tokens=7, start_step=2)]


def _tp1_answers(config: EngineConfig, num_blocks: int) -> tuple[list[list[int]], dict[str, list[int]]]:
    """The prompts and the greedy answers of a TP=1 runner (torch's thread count restored after)."""
    import torch

    from app.engine.model.hf_runner import HFRunner

    threads = torch.get_num_threads()
    tp1 = HFRunner(config, num_blocks)
    prompts = _prompts(tp1.tokenizer)
    expected = play_engine(tp1, _seqs(prompts))
    del tp1
    torch.set_num_threads(threads)
    return prompts, expected


def test_tp2_matches_tp1_and_shuts_down_cleanly():
    from app.engine.parallel.tp import TPGroupError, TPRunner, shm_path

    # float32 pinned: dtype auto is bfloat16 on a CPU with native bfloat16 (the next test's case)
    config = EngineConfig(kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1, dtype="float32")
    num_blocks = config.kv_pool_blocks(1)
    prompts, expected = _tp1_answers(config, num_blocks)

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
    assert not any(os.path.exists(shm_path("127.0.0.1", tp2.master_port, r)) for r in range(2))


def test_tp2_bfloat16_matches_tp1_bfloat16():
    """dtype bfloat16 under TP=2: DeepSpeed's sharded layers run their own forward in bfloat16 (their
    all-reduce inside), where TP=1 widens the bfloat16 weights and sums in float32; the greedy answers
    agree up to a near-tie (bfloat16 sums may break one the other way), measured on transformers' model
    of the same bfloat16-rounded weights in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from app.engine.parallel.tp import TPRunner
    from app.paths import model_dir

    config = EngineConfig(kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1, dtype="bfloat16")
    num_blocks = config.kv_pool_blocks(1)
    prompts, expected = _tp1_answers(config, num_blocks)
    tp2 = TPRunner(config.model_copy(update={"tensor_parallel_size": 2}), num_blocks)
    try:
        got = play_engine(tp2, _seqs(prompts))
    finally:
        tp2.shutdown()
    same_weights = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.bfloat16).float().eval()
    prompt = {seq.rid: seq.prompt for seq in _seqs(prompts)}
    assert all(turns_only_at_near_ties(same_weights, prompt[k], got[k], expected[k]) for k in expected), (got, expected)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.ray
def test_tp2_serve_replica_with_ray_actor_ranks_in_its_placement_group(tmp_path):
    """An engine-server replica with tensor_parallel_size 2: its ranks are Ray actors in the replica's
    placement group (Serve's placement_group_bundles), and it answers what tp=1 answers."""
    import asyncio

    import ray
    from ray import serve

    from app import paths
    from app.engine.engine import LLMEngine
    from app.engine.request import EngineRequest, SamplingParams
    from deployments.engine_server import EngineServerDeployment

    engine_config = {"kv_cache_tokens": 1024, "torch_threads": 1}
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    local = LLMEngine.from_config(EngineConfig(**engine_config))
    prompt = local.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    local.add_request(EngineRequest(prompt=prompt, sampling=SamplingParams(max_tokens=12, temperature=0.0), request_id="x"))
    expected, expected_tokens = "", 0
    while local.has_unfinished_requests():
        for out in local.step():
            expected, expected_tokens = expected + out.text_delta, out.num_output_tokens
    del local

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"FORESERVE_HOME": str(home), "HF_HUB_OFFLINE": "1"}})
    shm_before = set(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*"))
    try:
        app = EngineServerDeployment.options(
            name="online", ray_actor_options={"num_cpus": 0},
            placement_group_bundles=[{"CPU": 0.1}, {"CPU": 0.5}, {"CPU": 0.5}], placement_group_strategy="STRICT_PACK",
        ).bind("online", {**engine_config, "tensor_parallel_size": 2})
        serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on port 8000
        handle = serve.run(app, name="tp-test", route_prefix=None).options(stream=True)
        request = {"messages": messages, "sampling": {"max_tokens": 12, "temperature": 0.0}, "prediction": {"bucket": 0, "bound_tokens": 102}}

        async def collect() -> list[dict]:
            return [item async for item in handle.generate.remote(request)]

        items = asyncio.run(collect())
        assert "".join(i["text"] for i in items) == expected and items[-1]["completion_tokens"] == expected_tokens
        # the ranks named their shm buffers after the node's address (MASTER_ADDR) and unlinked them
        assert set(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*")) <= shm_before
        groups = [g for g in ray.util.placement_group_table().values() if len(g["bundles"]) == 3]
        assert len(groups) == 1 and groups[0]["state"] == "CREATED"
        assert ray.available_resources().get("CPU", 0) <= 2 - 1.1 + 1e-6  # replica + 2 rank bundles reserved
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_tp2_equals_tp1_on_other_families(tmp_path, kind):
    """DeepSpeed AutoTP shards transformers' modules of a Qwen3 (per-head q/k norms) and a Gemma 3
    (sliding windows, four norms a layer); each rank runs the family's forward on its heads, and the
    greedy tokens equal TP=1's (a tiny random model of each: tests/arch_models.py)."""
    import torch

    from app.engine.model.hf_runner import HFRunner
    from app.engine.parallel.tp import TPRunner
    from tests.arch_models import save_tiny

    save_tiny(kind, tmp_path)
    config = EngineConfig(model=str(tmp_path), kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1,
                          dtype="float32", max_num_batched_tokens=64)
    num_blocks = config.kv_pool_blocks(1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (30, 19)]
    threads = torch.get_num_threads()
    expected = play_engine(HFRunner(config, num_blocks, with_tokenizer=False), _seqs(prompts))
    torch.set_num_threads(threads)
    tp2 = TPRunner(config.model_copy(update={"tensor_parallel_size": 2}), num_blocks, with_tokenizer=False)
    try:
        assert [(i["num_heads"], i["num_kv_heads"]) for i in tp2.rank_info] == [(2, 1), (2, 1)]
        assert play_engine(tp2, _seqs(prompts)) == expected
    finally:
        tp2.shutdown()
