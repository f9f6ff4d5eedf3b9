"""Qwen2 and Qwen2.5: the Llama layer with biases on q, k and v (none on o), and a sliding window
only where ``use_sliding_window`` asks for one, on the layers from ``max_window_layers`` on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from app.engine.model.arch.config import ArchConfig, common_fields
from app.engine.model.arch.decoder import Decoder
from app.engine.model.arch.modules import CausalLM, DecoderLayer, DecoderModel

ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPES = ("qwen2",)


def parse(raw: dict, model_path: str | Path | None = None) -> ArchConfig:
    c = ArchConfig(**common_fields(raw, model_path))
    layers, window = c.num_hidden_layers, raw.get("sliding_window")
    if raw.get("layer_types") is None:
        first = raw.get("max_window_layers", 28)  # transformers' default
        windowed = raw.get("use_sliding_window", False) and window
        c = replace(c, layer_window=tuple(window if windowed and i >= first else None for i in range(layers)))
    return replace(c, qkv_bias=True, o_bias=False)


def build(c: ArchConfig) -> CausalLM:
    return CausalLM(c, DecoderModel(c, DecoderLayer))


DECODER = Decoder
