"""The architecture families foreserve runs, one module each, and the one place a model folder is
matched to its family: an architecture not listed is refused before anything loads.

A family module has ``ARCHITECTURES`` (the ``config.json`` names it runs; ``MODEL_TYPES`` where a
config names no architecture), ``parse(raw, path)`` ->
``ArchConfig``, ``build(config)`` -> its modules on the meta device (transformers' names), and
``DECODER``, its forward over the paged KV pool (``decoder.Decoder`` or a subclass)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from app.engine.model.arch import gemma3, llama, phi3, qwen2, qwen3
from app.engine.model.arch.config import ArchConfig, read_config
from app.engine.model.arch.modules import load_checkpoint, weight_files

FAMILIES: tuple[ModuleType, ...] = (llama, qwen2, qwen3, gemma3, phi3)
SUPPORTED: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.ARCHITECTURES)


class UnsupportedModel(ValueError):
    """A model folder foreserve cannot run; the message says why and what it runs."""


def family_of(raw: dict) -> ModuleType:
    """The family of a config's ``architectures`` (or, where it names none, of its ``model_type``)."""
    names = raw.get("architectures") or []
    for family in FAMILIES:
        if any(name in family.ARCHITECTURES for name in names):
            return family
    if not names:
        for family in FAMILIES:
            if raw.get("model_type") in family.MODEL_TYPES:
                return family
    label = ", ".join(names) or f"model_type {raw.get('model_type')!r} with no architectures"
    raise UnsupportedModel(f"architecture {label} is not supported; foreserve runs {', '.join(SUPPORTED)}")


def arch_config(model_path: str | Path) -> tuple[ModuleType, ArchConfig]:
    """The family and parsed config of a model folder; raises ``UnsupportedModel`` for one it cannot run."""
    raw = read_config(model_path)
    family = family_of(raw)
    if "quantization_config" in raw:
        raise UnsupportedModel(f"{model_path}: quantized checkpoints are not supported (foreserve loads float "
                               "weights; a GGUF file is de-quantized by `foreserve prepare --model`)")
    try:
        return family, family.parse(raw, model_path)
    except (KeyError, ValueError) as exc:
        raise UnsupportedModel(f"{model_path}: {exc}") from exc


def load_model(model_path: str | Path, model_impl: str, dtype: torch.dtype, device: torch.device,
               arch: tuple[ModuleType, ArchConfig] | None = None) -> nn.Module:
    """The checkpoint in foreserve's modules or transformers', as ``model_impl`` asks (``auto``: ours
    wherever the folder has safetensors weights). The forward is the family's either way. ``arch``:
    ``arch_config(model_path)``, where the caller has read it already."""
    family, config = arch or arch_config(model_path)
    try:
        weight_files(Path(model_path))
        reason = None
    except FileNotFoundError:
        reason = "no safetensors weights"
    if model_impl == "foreserve" and reason:
        raise ValueError(f"model_impl foreserve cannot run {model_path} ({reason}): use auto or transformers")
    if model_impl == "transformers" or reason:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    with torch.device("meta"):
        model = family.build(config)
    return load_checkpoint(model, Path(model_path), dtype, device)


def kv_bytes_per_token(config: ArchConfig, dtype: str | torch.dtype) -> int:
    """K + V bytes one token takes over all layers (whole model, all ranks together) with the cache
    in ``dtype``; a windowed layer counts every position too (its blocks are not freed early)."""
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem
