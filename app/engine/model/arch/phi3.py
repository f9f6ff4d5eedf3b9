"""Phi-3: the Llama layer with q, k and v fused in one projection (``qkv_proj``) and the MLP's gate
and up in another (``gate_up_proj``, gate first), a partial rotary dimension where the config sets
one, and its sliding window."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from app.engine.model.arch.config import ArchConfig, common_fields
from app.engine.model.arch.decoder import Decoder
from app.engine.model.arch.modules import CausalLM, DecoderLayer, DecoderModel, activation
from app.engine.model.cpu_linear import LayerLinears

ARCHITECTURES = ("Phi3ForCausalLM",)
MODEL_TYPES = ("phi3",)


def parse(raw: dict, model_path: str | Path | None = None) -> ArchConfig:
    return ArchConfig(**common_fields(raw, model_path))


class FusedAttention(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=False)


class FusedMLP(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.activation_fn = activation(c.hidden_act)


def build(c: ArchConfig) -> CausalLM:
    return CausalLM(c, DecoderModel(c, lambda c: DecoderLayer(c, attention=FusedAttention, mlp=FusedMLP)))


class Phi3Decoder(Decoder):
    def local_heads(self, attn: nn.Module) -> tuple[int, int]:
        c = self.config
        total = c.num_attention_heads + 2 * c.num_key_value_heads
        local = attn.qkv_proj.weight.shape[0] // c.head_dim  # fewer on a TP shard, in the same ratio
        return c.num_attention_heads * local // total, c.num_key_value_heads * local // total

    def linear_groups(self) -> list[LayerLinears]:
        return [LayerLinears([layer.self_attn.qkv_proj], layer.self_attn.o_proj, [layer.mlp.gate_up_proj],
                             layer.mlp.down_proj) for layer in self.layers]

    def qkv_of(self, i: int) -> nn.Module:  # fused in the checkpoint (prepacked, or a TP shard's own)
        return self.k.fused_qkv[i] or self.layers[i].self_attn.qkv_proj

    def gate_up_of(self, i: int) -> nn.Module:
        return self.k.fused_gate_up[i] or self.layers[i].mlp.gate_up_proj

    def activation(self, i: int) -> nn.Module:
        return self.layers[i].mlp.activation_fn


DECODER = Phi3Decoder
