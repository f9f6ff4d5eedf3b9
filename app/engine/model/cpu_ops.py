"""The runner's C++ ops on a CPU (``cpu_kernels.py``), chosen once per runner; among them a decoder
layer in one call for decode steps (``csrc/decode_layer.cpp``).

At one row, a layer's kernels take ~0.8 ms on 2 cores, and the ~14 torch calls the Python forward
makes between them (slices, views, chunk, silu, mul, allocations) took 3-4 ms of a 33 ms step of
SmolLM2-135M. ``decode_layer`` runs the same kernels in the same order from C++, so a step that
takes it gives the same logits to the bit (``tests/unit/test_cpu_kernels.py``, ``tests/model/test_runner.py``).

It applies where every linear goes through ``linear_bf16w``: bfloat16 weights on a CPU where
foreserve's kernels take few rows (``cpu_linear.bf16_kernel_rows``) and at most that many rows, a
plain Llama layer (fused q-k-v and gate-up, SiLU, float32 RMSNorms of one eps, no biases, no QK
norms, no sliding window, full-width RoPE: ``arch/llama.py`` says), and a step whose rows are all
decode rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.engine.model.step_inputs import Step

# (input norm weight, qkv weight, o weight, post-attention norm weight, gate-up weight, down weight, eps)
LayerWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]


@dataclass(frozen=True)
class CpuOps:
    """The C++ ops a runner calls; None where one does not apply (or the kernels cannot be built)."""

    paged_decode: Callable | None = None  # decode attention straight from the paged pool
    rope_store: Callable | None = None  # RoPE + the K/V store, for fused q, k, v
    add_rms_norm: Callable | None = None  # the residual add + RMSNorm
    silu_mul: Callable | None = None  # SiLU(gate) * up of the fused gate-up output
    decode_layer: Callable | None = None  # a whole layer of a decode step...
    layer_weights: list[LayerWeights] | None = None  # ...and its arguments, by layer
    layer_packed: list[list[torch.Tensor]] | None = None  # ...and its linears' packed panels (or none), by layer
    fused_rows: int = 0  # ...for decode steps of up to this many rows


def cpu_ops(fused_qkv: list, fused_gate_up: list, silu: bool, bf16w_rows: int,
            layer_weights: Callable[[], list[LayerWeights] | None], layer_linears: list,
            fast: dict[torch.nn.Module, Callable] | None = None) -> CpuOps:
    """The ops for a model's layers (``silu``: every layer's MLP is SiLU-gated; ``bf16w_rows``: the
    linears run ``linear_bf16w`` up to this many rows, 0 never; ``layer_weights``: the family's
    ``decode_layer`` arguments, or None where it cannot run them; ``layer_linears``: each layer's
    ``LayerLinears``; ``fast``: ``pack_layers``' functions by module, whose ``BF16Linear``s hold the
    packed panels)."""
    from app.engine.model import cpu_kernels

    rope_store = cpu_kernels.rope_store_op() if any(fused_qkv) else None
    weights = layer_weights() if bf16w_rows and rope_store and silu else None
    return CpuOps(paged_decode=cpu_kernels.paged_decode_op(), rope_store=rope_store,
                  add_rms_norm=cpu_kernels.add_rms_norm_op(), silu_mul=cpu_kernels.silu_mul_op() if silu else None,
                  decode_layer=cpu_kernels.decode_layer_op() if weights else None, layer_weights=weights,
                  layer_packed=None if weights is None else layer_packed(layer_linears, fused_qkv, fused_gate_up, fast or {}),
                  fused_rows=bf16w_rows if weights else 0)


def layer_packed(layers: list, fused_qkv: list, fused_gate_up: list,
                 fast: dict[torch.nn.Module, Callable]) -> list[list[torch.Tensor]]:
    """Per layer, the packed panels of its four linears (q-k-v, o, gate-up, down) for ``decode_layer``,
    or none (its linears then take the dot-product kernel at every row count)."""
    out = []
    for layer, qkv, gate_up in zip(layers, fused_qkv, fused_gate_up):
        packed = [getattr(fast.get(m), "packed", None) for m in (qkv, layer.o, gate_up, layer.down)]
        out.append(packed if all(p is not None for p in packed) else [])
    return out


def decode_layer_weights(layers: list[torch.nn.Module], fused_qkv: list, fused_gate_up: list,
                         rms_params: dict[torch.nn.Module, tuple[torch.Tensor, float]]) -> list[LayerWeights] | None:
    """Each layer's arguments to ``decode_layer``, or None unless every layer is one it runs (its
    activation, SiLU, is checked once for all layers by ``cpu_ops``)."""
    weights: list[LayerWeights] = []
    for layer, qkv, gate_up in zip(layers, fused_qkv, fused_gate_up):
        attn, mlp = layer.self_attn, layer.mlp
        if qkv is None or gate_up is None or hasattr(attn, "q_norm"):
            return None
        linears = (qkv, attn.o_proj, gate_up, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear or m.bias is not None or m.weight.dtype != torch.bfloat16
               or not m.weight.is_contiguous() for m in linears):
            return None
        norms = [rms_params.get(layer.input_layernorm), rms_params.get(layer.post_attention_layernorm)]
        if norms[0] is None or norms[1] is None or norms[0][1] != norms[1][1]:
            return None
        weights.append((norms[0][0], qkv.weight, attn.o_proj.weight, norms[1][0], gate_up.weight,
                        mlp.down_proj.weight, float(norms[0][1])))
    return weights


def takes_fused_layers(step: Step, max_rows: int) -> bool:
    """Whether ``step`` is one ``decode_layer`` runs: decode rows only, at most ``max_rows``
    (``CpuOps.fused_rows``: those ``linear_bf16w`` takes)."""
    rows = step.input_ids.shape[0]
    return step.decode_tables is not None and step.num_decode == rows and not step.prefills and 0 < rows <= max_rows
