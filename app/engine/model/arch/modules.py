"""The plain-torch modules the families build on, with transformers' module and parameter names
(so a checkpoint loads by name, and the same forward runs on transformers' or DeepSpeed's modules),
and the loader that assigns a safetensors checkpoint to modules built on the meta device.

Building on the meta device and assigning the checkpoint's tensors starts an engine in ~1.5 s where
``AutoModelForCausalLM.from_pretrained`` took 4-4.5 s (3 s of it importing transformers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from app.engine.model.arch.config import ArchConfig
from predictor.modules import embedding

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": nn.SiLU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "gelu": nn.GELU,
}


def activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (foreserve runs {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]()


class RMSNorm(nn.Module):
    """transformers' Llama RMSNorm: normalized in float32, scaled by ``weight`` in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=c.o_bias)


class QKNormAttention(Attention):
    """Attention with a norm over each head of q and of k (Qwen3, Gemma 3), of class ``norm``."""

    norm: type[nn.Module] = RMSNorm

    def __init__(self, c: ArchConfig) -> None:
        super().__init__(c)
        self.q_norm = self.norm(c.head_dim, c.rms_norm_eps)
        self.k_norm = self.norm(c.head_dim, c.rms_norm_eps)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, c: ArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act_fn = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm layer: attention, then the MLP, each after its RMSNorm."""

    def __init__(self, c: ArchConfig, attention: type[nn.Module] = Attention, mlp: type[nn.Module] = GatedMLP,
                 norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.self_attn = attention(c)
        self.mlp = mlp(c)
        self.input_layernorm = norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = norm(c.hidden_size, c.rms_norm_eps)


class DecoderModel(nn.Module):
    def __init__(self, c: ArchConfig, layer: Callable[[ArchConfig], nn.Module], norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layer(c) for _ in range(c.num_hidden_layers))
        self.norm = norm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """Modules only: a family's decoder (``arch/*.py``) runs the forward over the paged KV pool."""

    def __init__(self, config: ArchConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def weight_files(model_path: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards its index names)."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return [model_path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{model_path} has no model.safetensors (or index): foreserve loads safetensors checkpoints")
    return [single]


def checkpoint_name(name: str) -> str | None:
    """A checkpoint tensor's module name, or None for one the modules do not hold (older Llama
    checkpoints saved RoPE's ``inv_freq`` buffers: foreserve computes RoPE from the config)."""
    return None if name.endswith("rotary_emb.inv_freq") else name


def load_checkpoint(model: CausalLM, model_path: Path, dtype: torch.dtype, device: torch.device,
                    rename: Callable[[str], str | None] = checkpoint_name) -> CausalLM:
    """Assigns the checkpoint's tensors (cast to ``dtype``) to ``model``, built on the meta device:
    no random init, one copy. ``rename`` maps a checkpoint name to the model's (None: not loaded)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_path):
        for name, t in load_file(path, device=str(device)).items():
            if (ours := rename(name)) is not None:
                state[ours] = t.to(dtype)
    tied = model.config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if tied else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{model_path}: checkpoint does not match a {model.config.architecture} of its config.json "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)
