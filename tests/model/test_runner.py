"""HFRunner in float32 against Hugging Face generate, driven by a tiny stand-in engine
(tests/runner_helpers.py); bfloat16: test_runner_bf16.py.

Every test here loads SmolLM2-135M (the ``model`` marker, applied by tests/model/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from app.config import EngineConfig
from app.engine.outputs import ScheduledChunk, SchedulerOutput
from app.engine.request import SamplingParams
from tests.runner_helpers import (
    BLOCK, GREEDY, NEW_TOKENS, QUESTIONS, Seq, chat_prompts, generate_greedy, one_thread_runner, play_engine,
)


@pytest.fixture(scope="module")
def runner():
    with one_thread_runner("float32") as r:
        yield r


@pytest.fixture(scope="module")
def prompts(runner) -> list[list[int]]:
    return chat_prompts(runner.tokenizer)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own model and generate: the reference (the runner loads foreserve's Llama modules)."""
    from transformers import AutoModelForCausalLM

    from app.paths import model_dir

    return AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(runner, prompts, hf_model) -> list[list[int]]:
    return generate_greedy(hf_model, prompts, runner.eos_token_id)


@pytest.mark.model
def test_kv_bytes_per_token():
    from app.engine.model.arch import arch_config
    from app.engine.model.hf_runner import HFRunner
    from app.paths import model_dir

    hf = arch_config(model_dir())[1]
    assert HFRunner.kv_bytes_per_token(hf, "float32") == 2 * 30 * 3 * 64 * 4
    assert HFRunner.kv_bytes_per_token(hf, torch.bfloat16) == 2 * 30 * 3 * 64 * 2


@pytest.mark.model
def test_runner_loads_foreserve_llama_by_default_and_transformers_on_request(runner, prompts, reference):
    from app.engine.model.arch.modules import CausalLM
    from app.engine.model.hf_runner import HFRunner

    assert type(runner.model) is CausalLM
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight  # tied, as in the checkpoint
    config = EngineConfig(kv_cache_tokens=512, block_size_tokens=BLOCK, torch_threads=1, model_impl="transformers",
                          dtype="float32")
    hf_runner = HFRunner(config, config.kv_pool_blocks(1))
    assert type(hf_runner.model).__module__.startswith("transformers.")
    got = play_engine(hf_runner, [Seq("t", prompts[0], GREEDY)])
    assert got["t"] == reference[0]


@pytest.mark.model
def test_runner_shapes(runner):
    assert runner.k_cache.shape == (30, runner.num_blocks, BLOCK, 3, 64)
    assert (runner.num_heads, runner.num_kv_heads) == (9, 3)
    assert runner.eos_token_id == 2


@pytest.mark.model
@pytest.mark.parametrize("i", range(len(QUESTIONS)))
def test_greedy_alone_matches_generate(runner, prompts, reference, i):
    out = play_engine(runner, [Seq("a", prompts[i], GREEDY)])
    assert out["a"] == reference[i]
    assert len(reference[i]) >= 5


@pytest.mark.model
def test_greedy_mixed_batch_matches_generate(runner, prompts, reference):
    seqs = [
        Seq("b", prompts[1], GREEDY),  # whole-prompt prefill, then decodes while "a" prefills
        Seq("c", prompts[2], GREEDY, chunk_tokens=13),
        Seq("a", prompts[0], GREEDY, chunk_tokens=7, start_step=3),  # chunked, starts late
    ]
    out = play_engine(runner, seqs)
    assert [out["a"], out["b"], out["c"]] == reference


@pytest.fixture(scope="module")
def gather_runner(runner):
    """Decode attention by gather + SDPA (the path where the C++ kernel is off or cannot be built)."""
    from app.engine.model.hf_runner import HFRunner

    config = EngineConfig(kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1, cpu_paged_attention=False,
                          dtype="float32")
    return HFRunner(config, config.kv_pool_blocks(1))


@pytest.mark.model
def test_runner_decodes_with_the_paged_kernel_unless_told_not_to(runner, gather_runner):
    assert runner.ops.paged_decode is not None  # built here (tests/unit/test_cpu_kernels.py checks it alone)
    assert gather_runner.ops.paged_decode is None


@pytest.mark.model
@pytest.mark.parametrize("path", ["paged_kernel", "gather"])
def test_greedy_in_several_decode_groups_matches_generate(runner, gather_runner, prompts, reference, path):
    """18 sequences, staggered so their contexts differ: decode rows sorted by context and cut into
    groups (each its own padded gather and SDPA), or all read from the pool by the kernel; every
    sequence still matches generate."""
    seqs = [Seq(f"{i}-{k}", prompts[i], GREEDY, start_step=k) for k in range(6) for i in range(3)]
    out = play_engine(runner if path == "paged_kernel" else gather_runner, seqs)
    assert all(out[f"{i}-{k}"] == reference[i] for k in range(6) for i in range(3))


@pytest.mark.model
def test_bfloat16_kv_cache_halves_kv_bytes_and_keeps_greedy_answers(prompts, reference):
    """kv_cache_dtype bfloat16 under float32 weights: half the KV bytes per token; greedy answers
    (mixed prefill and decode) start as those of float32 generate on these prompts.

    NOTE: a bf16 cache is lossy, so a near-tie between two tokens may flip late in an answer, and
    where depends on the CPU's kernels: on an AVX512-BF16 machine one of the three answers
    turned at its 21st token of 24. The first 16 tokens of every answer must agree."""
    from app.engine.model.arch import arch_config
    from app.engine.model.hf_runner import HFRunner

    config = EngineConfig(kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1, dtype="float32",
                          kv_cache_dtype="bfloat16")
    hf = arch_config(config.model_path)[1]
    assert HFRunner.kv_bytes_per_token(hf, config.cache_dtype) * 2 == HFRunner.kv_bytes_per_token(hf, "float32")
    r = HFRunner(config, config.kv_pool_blocks(1))
    assert r.k_cache.dtype == torch.bfloat16 and next(r.model.parameters()).dtype == torch.float32
    assert r.ops.paged_decode is not None  # the kernel reads bfloat16 K/V too
    seqs = [Seq("b", prompts[1], GREEDY), Seq("c", prompts[2], GREEDY, chunk_tokens=13),
            Seq("a", prompts[0], GREEDY, chunk_tokens=7, start_step=3)]
    out = play_engine(r, seqs)
    answers = [out["a"], out["b"], out["c"]]
    assert [len(a) for a in answers] == [len(a) for a in reference]
    assert [a[:16] for a in answers] == [a[:16] for a in reference]


@pytest.mark.model
def test_seeded_sampling_reproducible_and_top_k1_is_greedy(runner, prompts, reference):
    hot = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=NEW_TOKENS)
    first = play_engine(runner, [Seq("s", prompts[1], hot)])["s"]
    # same seed, batched with other work and a different request id: same tokens
    again = play_engine(runner, [Seq("g", prompts[0], GREEDY), Seq("s2", prompts[1], hot, chunk_tokens=9)])["s2"]
    assert first == again
    other = play_engine(runner, [Seq("s", prompts[1], hot.model_copy(update={"seed": 99}))])["s"]
    assert other != first
    top1 = SamplingParams(temperature=0.7, top_k=1, seed=5, max_tokens=NEW_TOKENS)
    assert play_engine(runner, [Seq("k", prompts[2], top1)])["k"] == reference[2]


@pytest.mark.model
def test_rejects_chunk_beyond_block_table(runner):
    chunk = ScheduledChunk("x", list(range(10, 30)), 0, [0], True, GREEDY, 0)
    with pytest.raises(ValueError, match="exceed"):
        runner.execute(SchedulerOutput([chunk]))


@pytest.mark.model
def test_runner_prepacks_every_linear_unless_told_not_to(runner):
    from app.engine.model.hf_runner import HFRunner

    # per layer: q, k, v fused into one, o, gate and up fused into one, down; + the LM head
    assert len(runner.packed) == 30 * 4 + 1
    assert all(f is not None for f in runner.fused_qkv + runner.fused_gate_up)
    a = runner.layers[0].self_attn  # the projections' weights are views of the fused one, not copies
    assert a.k_proj.weight.untyped_storage().data_ptr() == runner.fused_qkv[0].weight.untyped_storage().data_ptr()
    plain = HFRunner(EngineConfig(kv_cache_tokens=64, block_size_tokens=BLOCK, cpu_prepacked_linears=False), 4)
    assert plain.packed == {} and plain.fused_qkv == [None] * 30


@pytest.mark.model
def test_a_built_runner_meets_no_new_linear_shape_in_its_steps(runner, capfd):
    """oneDNN builds a kernel (a primitive, about 1 MB) for each row count a prepacked linear meets,
    and keeps it: met while serving, the engine's memory grew with every new step size
    (docs/chaos.md). A built runner has them all: every row count a step can bring (its token
    budget; the LM head, its sampled rows) finds its primitive in oneDNN's cache."""
    import ctypes

    from app.engine.model.cpu_linear import onednn_row_counts

    budget = runner.config.max_num_batched_tokens
    body_rows = onednn_row_counts(budget)
    head_rows = onednn_row_counts(min(budget, runner.config.max_num_seqs))
    shapes = {}  # one module per weight shape: those of a shape share their primitives
    for m, f in runner.packed.items():
        shapes.setdefault((tuple(m.weight.shape), m is runner.lm_head), (m, f))
    capfd.readouterr()
    with torch.inference_mode(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        for (_, head), (m, f) in shapes.items():
            for n in head_rows if head else body_rows:
                f(torch.zeros(n, m.weight.shape[1]))
    ctypes.CDLL(None).fflush(None)  # oneDNN prints through C's buffered stdout
    created = [line for line in capfd.readouterr().out.splitlines() if ",create:" in line]
    assert len(shapes) == 5 and len(created) >= len(body_rows) * 4 + len(head_rows)
    assert [line for line in created if "cache_miss" in line] == []
