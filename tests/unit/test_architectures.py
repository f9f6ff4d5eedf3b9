"""Every supported architecture family against transformers: a tiny random model of each (built from
transformers' config classes, tests/arch_models.py), greedy tokens equal to ``generate``'s in float32
in a mixed batch with chunked prefill and a preemption, through both attention paths; bfloat16 within
the near-tie rule of tests/runner_helpers.py; and what is refused before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

from app.config import EngineConfig
from app.engine.request import SamplingParams
from tests.arch_models import KINDS, WINDOW, save_tiny
from tests.runner_helpers import BLOCK, Seq, play_engine, turns_only_at_near_ties

NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)
PROMPT_LENS = (5, 2 * WINDOW + 3, 3 * WINDOW + 7)  # the longer two reach past the sliding window


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return request.param, folder, hf, prompts


def reference(hf, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy answers, cut after the first EOS (the runner stops there)."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
            ends = [k for k, t in enumerate(gen) if t == 2]
            out.append(gen[: ends[0] + 1] if ends else gen)
    return out


def runner_for(folder, dtype: str, paged: bool):
    from app.engine.model.hf_runner import HFRunner

    config = EngineConfig(model=str(folder), dtype=dtype, kv_cache_tokens=2048, block_size_tokens=BLOCK, torch_threads=1,
                          cpu_paged_attention=paged, max_num_batched_tokens=64)
    return HFRunner(config, config.kv_pool_blocks(1), with_tokenizer=False)


def mixed_batch(runner, prompts: list[list[int]]) -> list[list[int]]:
    """The three prompts in one batch: admitted at different steps, prefilled in chunks of 7, 16 and 5
    tokens, the second one preempted mid-answer and recomputed."""
    seqs = [Seq("a", prompts[0], GREEDY, chunk_tokens=7), Seq("b", prompts[1], GREEDY, chunk_tokens=16, start_step=1,
                                                          preempt_step=12),
            Seq("c", prompts[2], GREEDY, chunk_tokens=5, start_step=3)]
    out = play_engine(runner, seqs, max_new=NEW)
    return [out[s.rid] for s in seqs]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "gather"])
def test_greedy_float32_equals_transformers(tiny, paged):
    kind, folder, hf, prompts = tiny
    runner = runner_for(folder, "float32", paged)
    assert (runner.ops.paged_decode is not None) == paged
    assert mixed_batch(runner, prompts) == reference(hf, prompts), kind


def test_greedy_bfloat16_parts_from_float32_only_at_near_ties(tiny):
    kind, folder, hf, prompts = tiny
    same = save_tiny(kind, folder.parent / f"{kind}-rounded")  # the same seed: the same weights...
    with torch.no_grad():
        for p in same.parameters():  # ...rounded as the bfloat16 runner holds them
            p.copy_(p.to(torch.bfloat16).float())
    got = mixed_batch(runner_for(folder, "bfloat16", True), prompts)
    refs = reference(same, prompts)
    assert all(turns_only_at_near_ties(same, p, g, r) for p, g, r in zip(prompts, got, refs)), (kind, got, refs)


def test_each_family_reads_its_config(tiny):
    from app.engine.model.arch import arch_config

    kind, folder, hf, _ = tiny
    _, c = arch_config(folder)
    windows = {"mistral": {WINDOW}, "phi3": {WINDOW}, "gemma3": {WINDOW}}.get(kind, set())
    assert c.windows == windows and c.eos_token_ids == (2,) and c.num_key_value_heads == 2
    if kind == "gemma3":
        assert c.layer_window == (WINDOW, WINDOW, WINDOW, None) and c.ropes["sliding_attention"].theta == 10000.0
        assert c.ropes["full_attention"].theta == 1e6 and c.extra["query_pre_attn_scalar"] == 24
    if kind == "phi3":
        assert c.ropes["default"].rotary_dim == 8  # half of each 16-wide head
    if kind == "llama3":
        assert c.ropes["default"].rope_type == "llama3"


def test_an_unknown_architecture_is_refused_before_anything_loads(tmp_path):
    from app.engine.model.arch import SUPPORTED, UnsupportedModel, arch_config, load_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel is not supported; foreserve runs LlamaForCausalLM") as e:
        load_model(tmp_path, "auto", torch.float32, torch.device("cpu"))  # no weights there: nothing was read
    assert all(name in str(e.value) for name in SUPPORTED) and "Gemma3ForCausalLM" in SUPPORTED
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                      "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(UnsupportedModel, match="quantized"):
        arch_config(tmp_path)


def test_an_unsupported_rope_type_is_named(tmp_path):
    from app.engine.model.arch import UnsupportedModel, arch_config

    config = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"type": "longrope"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="RoPE type 'longrope' is not supported .*default, linear, llama3"):
        arch_config(tmp_path)


def test_a_folder_without_safetensors_needs_transformers(tmp_path):
    from app.engine.model.arch import load_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                                      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model(tmp_path, "foreserve", torch.float32, torch.device("cpu"))


def test_older_gemma3_configs_name_their_layers_by_pattern(tmp_path):
    """A config.json written before transformers' ``layer_types`` and ``rope_parameters``."""
    from app.engine.model.arch import arch_config

    config = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
              "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "query_pre_attn_scalar": 4, "eos_token_id": [1, 106]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 107]}))
    _, c = arch_config(tmp_path)
    assert c.layer_window == (512,) * 5 + (None, 512) and c.layer_rope[5] == "full_attention"
    assert c.ropes["full_attention"].theta == 1e6 and c.ropes["sliding_attention"].theta == 1e4
    assert c.eos_token_ids == (1, 106, 107) and c.hidden_act == "gelu_pytorch_tanh"


def test_llama_has_no_window_even_where_its_config_names_one(tmp_path):
    """transformers' Llama ignores ``sliding_window`` (only Mistral's layers honour it)."""
    from app.engine.model.arch import arch_config
    from app.engine.model.arch.modules import checkpoint_name

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 2, "num_attention_heads": 2, "sliding_window": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert arch_config(tmp_path)[1].windows == set()
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    assert arch_config(tmp_path)[1].layer_window == (4, 4)
    # older Llama checkpoints hold RoPE's buffers, which foreserve computes from the config
    assert checkpoint_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert checkpoint_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
