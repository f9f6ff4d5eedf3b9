"""Llama and Mistral: the base decoder layer (``decoder.Decoder``), RoPE of type default, linear or
llama3 (Llama 3.1-3.3), Mistral's sliding window, and the whole-layer C++ call for decode steps."""

from __future__ import annotations

from pathlib import Path

import torch

from app.engine.model.arch.config import ArchConfig, common_fields
from app.engine.model.arch.decoder import Decoder
from app.engine.model.arch.modules import CausalLM, DecoderLayer, DecoderModel
from app.engine.model.cpu_ops import LayerWeights, decode_layer_weights, takes_fused_layers
from app.engine.model.step_inputs import Step

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")


def parse(raw: dict, model_path: str | Path | None = None) -> ArchConfig:
    fields = common_fields(raw, model_path)
    mistral = "MistralForCausalLM" in (raw.get("architectures") or []) or raw.get("model_type") == "mistral"
    if not mistral:  # transformers' Llama has no window
        fields["layer_window"] = (None,) * fields["num_hidden_layers"]
    return ArchConfig(**fields)


def build(c: ArchConfig) -> CausalLM:
    return CausalLM(c, DecoderModel(c, DecoderLayer))


class LlamaDecoder(Decoder):
    def fused_layers_possible(self) -> bool:
        c = self.config
        return (not c.windows and c.hidden_act == "silu" and all(s.rotary_dim == c.head_dim for s in c.ropes.values()))

    def fused_layer_weights(self, fused_qkv: list, fused_gate_up: list, rms: dict) -> list[LayerWeights] | None:
        if not self.fused_layers_possible():
            return None
        return decode_layer_weights(self.layers, fused_qkv, fused_gate_up, rms)

    def fused_step(self, step: Step) -> bool:
        ops = self.k.ops
        return ops.decode_layer is not None and takes_fused_layers(step, ops.fused_rows)

    def fused_layer(self, i: int, h: torch.Tensor, delta: torch.Tensor | None, step: Step) -> torch.Tensor:
        T = h.shape[0]
        cos, sin = step.rope[self.rope_of(i)]
        ops, kv = self.k.ops, self.k.attention
        return ops.decode_layer(h, delta, *ops.layer_weights[i], cos.view(T, -1), sin.view(T, -1), step.slots,
                                kv.k_cache[i], kv.v_cache[i], step.decode_tables, step.decode_lens, self.num_heads,
                                self.num_kv_heads, self.scale, ops.layer_packed[i])


DECODER = LlamaDecoder
