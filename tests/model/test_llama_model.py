"""foreserve's Llama modules and tokenizer against transformers' own, on the real SmolLM2 checkpoint
(the refusals and fallbacks that need no checkpoint: tests/unit/test_tokenizer.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from app.engine.model.arch import arch_config, load_model
from app.engine.text.tokenizer import ChatTokenizer, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, trailing ones  ",
    "Unicode: naïve café, 東京, emoji 🚀🎉, Ελληνικά",
    "code:\n```python\ndef f(x):\n    return x ** 2  # square\n```\n\ttabbed",
    "Don't stop , he said . It 's fine !",
    "<|im_start|>user\nspecial tokens in the text<|im_end|>",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Write a poem about 🚀 and naïve cafés."}],
]


@pytest.mark.model
def test_config_and_weights_equal_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.paths import model_dir

    ours, theirs = arch_config(model_dir())[1], AutoConfig.from_pretrained(model_dir())
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    model = load_model(model_dir(), "auto", torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
    hf_state = hf.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, hf_state[name]), name
    layer, hf_layer = model.model.layers[3], hf.model.layers[3]
    x = torch.randn(5, ours.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(100, 105)
    with torch.inference_mode():
        assert torch.equal(layer.input_layernorm(x), hf_layer.input_layernorm(x))
        assert torch.equal(layer.mlp(x), hf_layer.mlp(x))
        from app.engine.model.rope import Rope

        ours_rope = Rope(ours.ropes["default"]).cos_sin(pos)
        for a, b in zip(ours_rope, hf.model.rotary_emb(x, pos[None])):
            assert torch.equal(a, b[0])


@pytest.mark.model
def test_tokenizer_equals_autotokenizer():
    from transformers import AutoTokenizer

    from app.paths import model_dir

    ours, theirs = load_tokenizer(model_dir()), AutoTokenizer.from_pretrained(model_dir())
    assert isinstance(ours, ChatTokenizer)
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), text
        ids = theirs.encode(text, add_special_tokens=False) + [theirs.eos_token_id]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    for messages in CONVERSATIONS:
        for gen in (False, True):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert text == theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ours.encode(text, add_special_tokens=False)


@pytest.mark.model
def test_tokenizer_with_a_template_jinja_cannot_compile_is_left_to_transformers(tmp_path):
    import shutil

    from app.paths import model_dir

    shutil.copy(model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% unknown_tag %}"}))
    assert ChatTokenizer.from_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert ChatTokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
