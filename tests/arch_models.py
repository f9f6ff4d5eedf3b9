"""Tiny random models of each supported architecture, built from transformers' config classes and
saved as a model folder (a few hundred KB, no download), for the runner's parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
WINDOW = 12  # tokens: prompts and answers reach past it


def tiny_config(kind: str):
    import transformers as tf

    if kind == "llama3":  # Llama 3.1's RoPE scaling
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**COMMON, rope_parameters=rope)
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=WINDOW)
    if kind == "qwen2":
        return tf.Qwen2Config(**{**COMMON, "tie_word_embeddings": True})
    if kind == "qwen3":
        return tf.Qwen3Config(**COMMON)
    if kind == "phi3":
        return tf.Phi3Config(**COMMON, sliding_window=WINDOW,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if kind == "gemma3":
        types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
        return tf.Gemma3TextConfig(**{**COMMON, "tie_word_embeddings": True}, sliding_window=WINDOW, layer_types=types,
                                   query_pre_attn_scalar=24, architectures=["Gemma3ForCausalLM"])
    raise KeyError(kind)


KINDS = ("llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma3")


def save_tiny(kind: str, folder: Path, seed: int = 0):
    """The model of ``kind`` with random weights (norms too: a norm's form shows), saved in ``folder``;
    returns transformers' model, float32, for reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(p + 0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return model
