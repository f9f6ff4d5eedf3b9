"""Qwen3: the Llama layer with an RMSNorm over each head of q and of k, before RoPE."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from app.engine.model.arch import qwen2
from app.engine.model.arch.config import ArchConfig
from app.engine.model.arch.decoder import Decoder
from app.engine.model.arch.modules import CausalLM, DecoderLayer, DecoderModel, QKNormAttention

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


def parse(raw: dict, model_path: str | Path | None = None) -> ArchConfig:
    from dataclasses import replace

    c = qwen2.parse(raw, model_path)  # the same window rule
    bias = bool(raw.get("attention_bias", False))
    return replace(c, qkv_bias=bias, o_bias=bias)


def build(c: ArchConfig) -> CausalLM:
    return CausalLM(c, DecoderModel(c, lambda c: DecoderLayer(c, attention=QKNormAttention)))


class Qwen3Decoder(Decoder):
    def qk_norm(self, i: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a: nn.Module = self.layers[i].self_attn
        return self.rms(a.q_norm, q), self.rms(a.k_norm, k)


DECODER = Qwen3Decoder
