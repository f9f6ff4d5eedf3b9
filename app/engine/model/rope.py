"""Rotary position embeddings from a model's config: the inverse frequencies of each RoPE type
foreserve runs (``default``, ``linear``, ``llama3``), a partial rotary dimension, and the angles of a
step's positions. Computed as transformers computes them, so float32 angles equal its to the bit."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE: ``theta``, its type and that type's parameters, over ``rotary_dim`` of each head."""

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    params: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, raw: dict, head_dim: int, partial: float = 1.0) -> "RopeSpec":
        """From a transformers ``rope_parameters``-style dict (``rope_theta``, ``rope_type`` or
        ``type``, its parameters; ``partial_rotary_factor`` here or given)."""
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} is not supported (foreserve runs {', '.join(ROPE_TYPES)})")
        factor = float(raw.get("partial_rotary_factor", partial))
        keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        params = tuple(sorted((k, float(raw[k])) for k in keep if raw.get(k) is not None))
        return cls(float(raw.get("rope_theta", 10000.0)), int(head_dim * factor), rope_type, params)

    def inv_freq(self) -> torch.Tensor:
        dim = self.rotary_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
        p = dict(self.params)
        if self.rope_type == "linear":
            return inv / p["factor"]
        if self.rope_type == "llama3":
            return _llama3(inv, p["factor"], p["low_freq_factor"], p["high_freq_factor"],
                           p["original_max_position_embeddings"])
        return inv


def _llama3(inv: torch.Tensor, factor: float, low: float, high: float, old_len: float) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by ``factor``, short ones
    kept, the band between interpolated."""
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rope:
    """The angles of one ``RopeSpec``: ``cos_sin(positions)`` -> cos, sin ``[T, rotary_dim]`` (float32)."""

    def __init__(self, spec: RopeSpec) -> None:
        self.spec = spec
        self.inv_freq = spec.inv_freq()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [T, heads, head_dim]`` with ``cos/sin [T, 1, rotary_dim]``; a partial
    rotary dimension rotates the first ``rotary_dim`` of each head and passes the rest."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
