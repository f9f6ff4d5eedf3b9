"""What the runner reads of a model folder's ``config.json`` (and ``generation_config.json``), the
same for every architecture family: shapes, norms, biases, each layer's RoPE and attention window,
and every EOS id. Each family's module fills in what is its own (``ArchConfig.extra``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.model.rope import RopeSpec


def read_config(model_path: str | Path) -> dict:
    """A model folder's ``config.json``."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_path} a Hugging Face model folder?")
    return json.loads(path.read_text())


def eos_ids(raw: dict, model_path: str | Path | None) -> tuple[int, ...]:
    """Every EOS id of the model: ``generation_config.json``'s (Llama 3 and Gemma list several), else
    ``config.json``'s."""
    ids = raw.get("eos_token_id")
    if model_path is not None and (gen := Path(model_path) / "generation_config.json").is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id") or ids
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def rope_parameters(raw: dict, key: str | None = None) -> dict:
    """The RoPE parameters of ``raw`` (those of layer type ``key`` where they are per type) in
    transformers 5's ``rope_parameters`` form, read from older configs' ``rope_theta`` and
    ``rope_scaling`` too."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and key is not None and key in params:
        return params[key]
    if isinstance(params, dict) and "rope_theta" in params:
        return params
    out = dict(raw.get("rope_scaling") or {})
    out.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return out


@dataclass(frozen=True)
class ArchConfig:
    """The fields the runner and a family's modules read, parsed once."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    ropes: dict[str, RopeSpec]  # by name; ``layer_rope`` names each layer's
    layer_rope: tuple[str, ...]
    layer_window: tuple[int | None, ...]  # a sliding window of this many tokens (itself included), or None
    eos_token_ids: tuple[int, ...]
    extra: dict = field(default_factory=dict)  # a family's own fields

    @property
    def windows(self) -> set[int]:
        return {w for w in self.layer_window if w is not None}


def common_fields(raw: dict, model_path: str | Path | None) -> dict:
    """The ``ArchConfig`` fields most families read the same way (a family overrides what it must)."""
    heads = raw["num_attention_heads"]
    layers = raw["num_hidden_layers"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    rope = RopeSpec.parse(rope_parameters(raw), head_dim, raw.get("partial_rotary_factor", 1.0))
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is not None:
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:
        windows = (window,) * layers
    return dict(
        architecture=(raw.get("architectures") or ["?"])[0], vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), hidden_act=raw.get("hidden_act", "silu"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        ropes={"default": rope}, layer_rope=("default",) * layers, layer_window=windows,
        eos_token_ids=eos_ids(raw, model_path),
    )
