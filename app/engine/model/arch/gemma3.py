"""Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorms that scale by (1 + w), norms before
and after both attention and the MLP, RMSNorms over each head of q and k, attention scaled by
``query_pre_attn_scalar``, a GELU (tanh) gated MLP, and two kinds of layers: five of every six attend
through a sliding window with their own RoPE base, the sixth to the whole context."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from app.engine.model.arch.config import ArchConfig, common_fields, rope_parameters
from app.engine.model.arch.decoder import Decoder
from app.engine.model.arch.modules import CausalLM, DecoderLayer, DecoderModel, GatedMLP, QKNormAttention, RMSNorm
from app.engine.model.rope import RopeSpec

ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPES = ("gemma3_text",)
SLIDING, FULL = "sliding_attention", "full_attention"


def parse(raw: dict, model_path: str | Path | None = None) -> ArchConfig:
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping is not supported (Gemma 3 has none)")
    raw = dict(raw, hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:  # older configs: every ``sliding_window_pattern``-th layer is a full one
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    raw["layer_types"] = types
    c = ArchConfig(**common_fields(raw, model_path))
    head_dim = c.head_dim
    full = rope_parameters({"rope_theta": 1e6, **raw}, FULL)  # transformers' Gemma 3 defaults
    if "rope_parameters" in raw and SLIDING in raw["rope_parameters"]:
        local = raw["rope_parameters"][SLIDING]
    else:
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    ropes = {FULL: RopeSpec.parse(full, head_dim), SLIDING: RopeSpec.parse(local, head_dim)}
    extra = {"query_pre_attn_scalar": raw.get("query_pre_attn_scalar", 256),
             "final_logit_softcapping": raw.get("final_logit_softcapping")}
    return replace(c, ropes=ropes, layer_rope=tuple(types), tie_word_embeddings=raw.get("tie_word_embeddings", True),
                   extra=extra)


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma3RMSNorm: normalized and scaled by ``1 + weight`` in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden), the scale rounded to the weights' dtype as transformers does."""

    def __init__(self, num: int, dim: int) -> None:
        meta = torch.get_default_device().type == "meta"
        super().__init__(num, dim, _weight=torch.empty(num, dim) if meta else None)
        self.scale = math.sqrt(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class GemmaAttention(QKNormAttention):
    norm = GemmaRMSNorm


class GemmaLayer(DecoderLayer):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__(c, attention=GemmaAttention, mlp=GatedMLP, norm=GemmaRMSNorm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)


class GemmaModel(DecoderModel):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__(c, GemmaLayer, norm=GemmaRMSNorm)
        self.embed_tokens = ScaledEmbedding(c.vocab_size, c.hidden_size)


def build(c: ArchConfig) -> CausalLM:
    return CausalLM(c, GemmaModel(c))


class Gemma3Decoder(Decoder):
    def __init__(self, model: nn.Module, config: ArchConfig) -> None:
        super().__init__(model, config)
        self.scale = float(config.extra["query_pre_attn_scalar"]) ** -0.5
        self.softcap = config.extra.get("final_logit_softcapping")

    def norm_weight(self, norm: nn.Module) -> torch.Tensor | None:
        w = super().norm_weight(norm)
        return None if w is None else 1.0 + w  # computed once (``rms_params``): a step multiplies as a plain RMSNorm does

    def qk_norm(self, i: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.layers[i].self_attn
        return self.rms(a.q_norm, q), self.rms(a.k_norm, k)

    def after_attention(self, i: int, h: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[i]
        o = self.rms(layer.post_attention_layernorm, self.linear(layer.self_attn.o_proj, o))
        h, x = self.add_norm(layer.pre_feedforward_layernorm, h, o)
        return h, self.rms(layer.post_feedforward_layernorm, self.mlp(i, x))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().logits(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


DECODER = Gemma3Decoder
