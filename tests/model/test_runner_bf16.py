"""HFRunner with bfloat16 weights (``dtype: bfloat16``): greedy answers against transformers on the
same bfloat16-rounded weights, the decode kernel's row bound, whole layers in one call, and prompt
chunks folded into decode rows; driven by the stand-in engine of tests/runner_helpers.py.

Every test here loads SmolLM2-135M (the ``model`` marker, applied by tests/model/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from app.engine.model.step_inputs import build_step
from app.engine.outputs import ScheduledChunk
from tests.runner_helpers import (BLOCK, GREEDY, Seq, chat_prompts, generate_greedy, one_thread_runner, play_engine,
                                  turns_only_at_near_ties)


@pytest.fixture(scope="module")
def bf16_runner():
    with one_thread_runner("bfloat16") as r:
        yield r


@pytest.fixture(scope="module")
def prompts(bf16_runner) -> list[list[int]]:
    return chat_prompts(bf16_runner.tokenizer)


MIXED = [("b", 1, 10_000, 0), ("c", 2, 13, 0), ("a", 0, 7, 3)]  # whole prefill; chunks of 13; chunks of 7, late


@pytest.fixture(scope="module")
def same_weights_model():
    """transformers' model on the bfloat16-rounded weights, computing in float32."""
    from transformers import AutoModelForCausalLM

    from app.paths import model_dir

    return AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.bfloat16).float().eval()


@pytest.mark.model
def test_bfloat16_weights_match_generate_on_the_same_weights(bf16_runner, prompts, same_weights_model):
    """dtype bfloat16: bfloat16 weights and KV, float32 activations between the layers. Without
    native bfloat16 (foreserve's kernel, float32 products and sums): greedy answers, alone and in a
    mixed batch, equal transformers' generate in float32 on the same bfloat16-rounded weights, token
    for token; against transformers' generate in bfloat16 (bfloat16 activations too, which round
    every sum), the first 16 tokens of each answer agree (one answer turned at its 17th token of 24
    on such a CPU: a near-tie that bfloat16 activations break the other way). With native bfloat16,
    oneDNN's bfloat16 kernels take and give bfloat16 rows, so an answer may turn at a near-tie (the
    first token of one prompt here is ahead by 0.08 logits in float32) and where it does depends on
    the batch: every answer equals that reference up to a near-tie."""
    from transformers import AutoModelForCausalLM

    from app.engine.model.cpu_linear import native_bf16
    from app.paths import model_dir

    r = bf16_runner
    assert r.k_cache.dtype == torch.bfloat16 and r.act_dtype == torch.float32 and r.ops.paged_decode is not None
    assert r.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16 and len(r.packed) == 30 * 4 + 1
    same_weights = generate_greedy(same_weights_model, prompts, r.eos_token_id)
    out = play_engine(r, [Seq(name, prompts[i], GREEDY, chunk_tokens=c, start_step=s) for name, i, c, s in MIXED])
    mixed = [out["a"], out["b"], out["c"]]
    alone = [play_engine(r, [Seq("x", p, GREEDY)])["x"] for p in prompts]
    if native_bf16():
        for answers in (mixed, alone):
            assert all(turns_only_at_near_ties(same_weights_model, p, got, ref)
                       for p, got, ref in zip(prompts, answers, same_weights)), (answers, same_weights)
        return
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.bfloat16).eval()
    assert mixed == same_weights and alone == same_weights
    # bfloat16 activations round every sum: an answer may turn where two tokens nearly tie, nowhere else
    assert all(turns_only_at_near_ties(same_weights_model, p, got, ref)
               for p, got, ref in zip(prompts, mixed, generate_greedy(bf16, prompts, r.eos_token_id))), mixed


@pytest.mark.model
def test_bfloat16_decode_rows_either_side_of_the_kernel_give_the_same_answers(bf16_runner, prompts, same_weights_model,
                                                                              monkeypatch):
    """18 sequences, with foreserve's kernels taking up to 8 rows for the test (``BF16Linear.rows``
    and ``CpuOps.fused_rows``): steps of 2 to 8 decode rows run its kernel on the packed panels, steps
    of 1 its dot products, and steps of 9 to 18 oneDNN: without native bfloat16 its float32 copy of
    the bfloat16 weights, and every answer is the one it gives alone; with native bfloat16 its
    bfloat16 kernels, whose rows are rounded to bfloat16 (with AMX they take every step), and every
    answer is the one it gives alone up to a near-tie."""
    import dataclasses

    from app.engine.model.cpu_linear import BF16Linear, native_bf16

    for f in bf16_runner.packed.values():
        if isinstance(f, BF16Linear):
            monkeypatch.setattr(f, "rows", 8)
    monkeypatch.setattr(bf16_runner, "ops", dataclasses.replace(bf16_runner.ops, fused_rows=min(8, bf16_runner.ops.fused_rows)))
    alone = [play_engine(bf16_runner, [Seq("x", p, GREEDY)])["x"] for p in prompts]
    seqs = [Seq(f"{i}-{k}", prompts[i], GREEDY, start_step=k) for k in range(6) for i in range(3)]
    out = play_engine(bf16_runner, seqs)
    if native_bf16():
        assert all(turns_only_at_near_ties(same_weights_model, prompts[i], out[f"{i}-{k}"], alone[i])
                   for k in range(6) for i in range(3))
    else:
        assert all(out[f"{i}-{k}"] == alone[i] for k in range(6) for i in range(3))


@pytest.mark.model
def test_bfloat16_decode_steps_run_whole_layers_in_one_call_with_the_same_logits(bf16_runner, prompts,
                                                                                same_weights_model):
    """Where foreserve's kernels take few rows (``bf16_kernel_rows``: all but AMX CPUs), a decode step of
    up to that many rows runs each layer in one C++ call (csrc/decode_layer.cpp): the same kernels in the same order as the Python forward, so the
    logits and the K/V it stores are the same to the bit. Steps with a prefill run the Python forward."""
    import dataclasses

    from app.engine.model.cpu_linear import bf16_kernel_rows
    from app.engine.model.cpu_ops import takes_fused_layers

    r = bf16_runner
    if bf16_kernel_rows() == 0:
        assert r.ops.decode_layer is None  # oneDNN's bfloat16 kernels (AMX) run the linears
        return
    assert r.ops.fused_rows == bf16_kernel_rows() >= len(prompts)
    assert r.ops.decode_layer is not None and len(r.ops.layer_weights) == 30
    lens = [len(p) for p in prompts]
    tables = [list(range(sum(-(-n // BLOCK) for n in lens[:i]), sum(-(-n // BLOCK) for n in lens[:i + 1])))
              for i in range(len(prompts))]
    with torch.inference_mode():
        r.decoder.forward(r._prepare([ScheduledChunk(f"p{i}", p[:-1], 0, tables[i], False, GREEDY, 0)
                               for i, p in enumerate(prompts)]))  # the prompts' K/V but their last token
        decode = [ScheduledChunk(f"p{i}", p[-1:], len(p) - 1, tables[i], True, GREEDY, 0) for i, p in enumerate(prompts)]
        step = r._prepare(decode)
        assert takes_fused_layers(step, r.ops.fused_rows)
        kv = r.k_cache.clone(), r.v_cache.clone()
        fused = r.decoder.forward(step)
        kv_fused = r.k_cache.clone(), r.v_cache.clone()
        r.k_cache.copy_(kv[0]), r.v_cache.copy_(kv[1])
        ops, r.ops = r.ops, dataclasses.replace(r.ops, decode_layer=None)
        try:
            plain = r.decoder.forward(step)
        finally:
            r.ops = ops
    assert torch.equal(fused, plain) and torch.equal(kv_fused[0], r.k_cache) and torch.equal(kv_fused[1], r.v_cache)
    with torch.inference_mode():  # and they are the model's: each prompt's next token, up to a near-tie
        ref = [int(same_weights_model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    assert all(turns_only_at_near_ties(same_weights_model, p, [int(t)], [n])
               for p, t, n in zip(prompts, fused.argmax(-1).tolist(), ref)), (fused.argmax(-1).tolist(), ref)
    with_prompt = decode[:1] + [ScheduledChunk("q", prompts[0][:4], 0, [60], True, GREEDY, 0)]
    assert takes_fused_layers(r._prepare(with_prompt), r.ops.fused_rows)  # its 4 prompt tokens as decode rows
    assert not takes_fused_layers(build_step(with_prompt, BLOCK, r.decoder.ropes, r.act_dtype, paged=True),
                                  r.ops.fused_rows)


@pytest.mark.model
def test_prompt_chunks_run_as_decode_rows_give_the_answers_of_the_prefill_path(bf16_runner, prompts, same_weights_model):
    """A step of decode rows and prompt chunks of at most ``fused_rows`` tokens in all runs the
    fused layers, a prompt token at position p attending to the pool's [0, p] (``build_step``'s
    fold). Against the same step through the Python forward's prefill path (SDPA over the gathered
    context, over its own float32 K/V for a chunk at position 0, where the fold reads the pool's
    bfloat16) and against transformers in float32 on the same weights: the same argmax, logits no
    further from float32's than the prefill path's, and the same K/V stored in the first layer (within
    a bfloat16 step or two in the later ones)."""
    from app.engine.model.cpu_ops import takes_fused_layers

    r = bf16_runner
    if r.ops.decode_layer is None:
        pytest.skip("no fused layers on this CPU (AMX: oneDNN's bfloat16 kernels run the linears)")
    lens = [len(p) for p in prompts]
    tables = [list(range(sum(-(-n // BLOCK) for n in lens[:i]), sum(-(-n // BLOCK) for n in lens[:i + 1])))
              for i in range(len(prompts))]
    p0, p1, p2 = prompts[:3]
    with torch.inference_mode():
        r.decoder.forward(r._prepare([ScheduledChunk("a", p0[:-1], 0, tables[0], False, GREEDY, 0),
                               ScheduledChunk("b", p1[:-7], 0, tables[1], False, GREEDY, 0)]))
        chunks = [ScheduledChunk("a", p0[-1:], len(p0) - 1, tables[0], True, GREEDY, 0),  # a decode row
                  ScheduledChunk("b", p1[-7:], len(p1) - 7, tables[1], True, GREEDY, 0),  # a prompt's last chunk
                  ScheduledChunk("c", p2[:9], 0, tables[2], False, GREEDY, 0)]  # a prompt's first chunk
        folded_step = r._prepare(chunks)
        assert takes_fused_layers(folded_step, r.ops.fused_rows) and not folded_step.prefills
        by_position = sorted(chunks, key=lambda c: c.start_pos)  # rows by the chunks' first positions
        assert folded_step.decode_lens.tolist() == [pos + 1 for c in by_position
                                                    for pos in range(c.start_pos, c.start_pos + len(c.token_ids))]
        kv = r.k_cache.clone(), r.v_cache.clone()
        folded = r.decoder.forward(folded_step)
        kv_folded = r.k_cache.clone(), r.v_cache.clone()
        r.k_cache.copy_(kv[0]), r.v_cache.copy_(kv[1])
        plain_step = build_step(chunks, BLOCK, r.decoder.ropes, r.act_dtype, paged=True)
        plain = r.decoder.forward(plain_step)
    # the logits' rows by request: the fold orders rows by position, the prefill path decodes first
    order = [[c.request_id for c in st.sample_chunks].index(name) for st in (folded_step, plain_step) for name in "ab"]
    folded, plain = folded[order[:2]], plain[order[2:]]
    assert folded.shape == plain.shape == (2, r.vocab_size)
    with torch.inference_mode():
        want = torch.stack([same_weights_model(torch.tensor([p])).logits[0, -1] for p in (p0, p1)])
    assert folded.argmax(-1).tolist() == plain.argmax(-1).tolist() == want.argmax(-1).tolist()
    # NOTE: the prefill path's SDPA over the gathered context runs in bfloat16 (the query rounded, the
    # probabilities too); the paged kernel sums in float32. Largest logit error here: decode row 0.44
    # both ways (bfloat16 rows in the linears), the prompt chunk's last token 0.19 folded, 0.23 not.
    err_folded, err_plain = ((x - want).abs().amax(-1) for x in (folded, plain))
    assert (err_folded <= err_plain + 0.02).all(), (err_folded, err_plain)
    for got, want in zip(kv_folded, (r.k_cache, r.v_cache)):
        assert torch.equal(got[0], want[0])  # the first layer's K/V: the same slots, the same bits
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.25)  # later layers: a bfloat16 step or two
