"""A plain-torch Llama for the runner: HF's module and parameter names, loaded straight from safetensors.

The runner only uses a model's modules (embeddings, norms, projections, MLP, rotary embedding;
``app/engine/model/hf_runner.py`` has its own forward), so for a plain Llama checkpoint (SmolLM2, Llama 2/3
without RoPE scaling, TinyLlama...) it needs nothing of transformers. Building these modules on the
meta device and assigning the checkpoint's tensors makes an engine start in ~1.5 s where
``AutoModelForCausalLM.from_pretrained`` took 4-4.5 s here (3 s of it importing transformers): a
batch job's engines and a Serve replica start that much sooner. Any other model (RoPE scaling, QK
norms, another family), TP shards and ``model_impl: transformers`` keep transformers' classes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from predictor.modules import embedding


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a HF ``config.json`` the runner and these modules read."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_id: int | list[int] | None

    @classmethod
    def from_dict(cls, raw: dict) -> "LlamaConfig":
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}  # transformers 5; older configs: a top-level rope_theta
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_id=raw.get("eos_token_id"),
        )


def read_config(model_path: str | Path) -> dict:
    """A model folder's ``config.json``."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_path} a Hugging Face model folder?")
    return json.loads(path.read_text())


def unsupported(raw: dict) -> str | None:
    """Why this config needs transformers' classes, or None when these modules run it exactly."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    checks = {
        "model_type is not llama": raw.get("model_type") != "llama",
        "architecture is not LlamaForCausalLM": raw.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"],
        "activation is not silu": raw.get("hidden_act", "silu") != "silu",
        "RoPE scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
        "quantized weights": "quantization_config" in raw,
        "pretraining_tp > 1": raw.get("pretraining_tp", 1) != 1,
    }
    reasons = [reason for reason, failed in checks.items() if failed]
    return ", ".join(reasons) or None


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalized in float32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE: ``forward(x, position_ids)`` gives cos and sin ``[B, T, head_dim]`` in ``x``'s dtype."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # NOTE: an explicit device, so it is real even when the modules are built on the meta device
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.attention_bias)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=c.attention_bias)
        self.scaling = c.head_dim**-0.5


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope_theta)


class LlamaForCausalLM(nn.Module):
    """Modules only: the runner runs the forward over its paged KV pool."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
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


def load_llama(model_path: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The checkpoint's tensors assigned to modules built on the meta device (no random init, one copy)."""
    from safetensors.torch import load_file

    model_path = Path(model_path)
    config = LlamaConfig.from_dict(read_config(model_path))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_path):
        state.update(load_file(path, device=str(device)))
    state = {name: t.to(dtype) for name, t in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{model_path}: checkpoint does not match a Llama of its config.json "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)


def model_config(model_path: str | Path):
    """The shape fields of a model folder's config (``LlamaConfig``), or transformers' ``AutoConfig``
    where config.json lacks one of them at the top level."""
    try:
        return LlamaConfig.from_dict(read_config(model_path))
    except KeyError:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path)


def kv_bytes_per_token(hf_config, dtype: str | torch.dtype) -> int:
    """K + V bytes one token takes over all layers (whole model, all ranks together) of a model with
    config ``hf_config`` (``model_config``'s) with its cache in ``dtype``. Here, beside the config
    reader, so that sizing a KV pool (``app.config``) needs no runner."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * elem


def load_model(model_path: str | Path, model_impl: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The checkpoint in foreserve's Llama modules or transformers', as ``model_impl`` asks (``auto``:
    ours where ``unsupported`` finds nothing against it)."""
    reason = unsupported(read_config(model_path))
    try:
        weight_files(Path(model_path))
    except FileNotFoundError:
        reason = reason or "no safetensors weights"
    if model_impl == "foreserve" and reason:
        raise ValueError(f"model_impl foreserve cannot run {model_path} ({reason}): use auto or transformers")
    if model_impl == "transformers" or reason:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    return load_llama(model_path, dtype, device)
