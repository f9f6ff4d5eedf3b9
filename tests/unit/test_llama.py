"""foreserve's transformers-free model loading and tokenizer against transformers' own.

The runner's greedy answers on these modules equal HF generate's (tests/model/test_runner.py,
tests/model/test_engine_real.py); here: the choice of modules and the tokenizer's fallbacks, without
a checkpoint (the comparisons on the real SmolLM2: tests/model/test_llama_model.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from app.engine.model.llama import load_model, read_config, unsupported
from app.engine.text.tokenizer import ChatTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_unsupported_names_what_needs_transformers():
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert unsupported(llama) is None
    assert unsupported({**llama, "model_type": "qwen3"}) == "model_type is not llama"
    assert unsupported({**llama, "rope_parameters": {"rope_type": "llama3"}}) == "RoPE scaling"
    assert unsupported({**llama, "rope_parameters": None, "rope_scaling": {"type": "linear"}}) == "RoPE scaling"
    assert unsupported({**llama, "quantization_config": {}}) == "quantized weights"


def test_foreserve_impl_refuses_a_model_it_cannot_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="model_impl foreserve cannot run .*model_type is not llama"):
        load_model(tmp_path, "foreserve", torch.float32, torch.device("cpu"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # weights as .bin only
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model(tmp_path, "foreserve", torch.float32, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="Hugging Face model folder"):
        read_config(tmp_path / "nowhere")


def test_tokenizer_without_tokenizer_json_is_left_to_transformers(tmp_path):
    assert ChatTokenizer.from_dir(tmp_path) is None
