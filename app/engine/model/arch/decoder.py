"""A family's forward over the paged KV pool, and the pieces every family shares.

``Decoder`` runs a pre-norm decoder whose modules carry transformers' names (foreserve's own
modules, transformers' or DeepSpeed AutoTP's shards, whose row-parallel layers all-reduce inside):
embeddings, per layer attention then the MLP, the final norm and the LM head. The base class is the
Llama layer; a family overrides the parts it does differently (``arch/*.py``). All tokens of a step
are packed into one ``[T, hidden]`` tensor for the linear layers; attention goes through
``PagedAttention``. On a CPU the activations are float32 whatever the weights' dtype: bfloat16
weights halve the bytes a step streams, and norms, softmax and sums keep float32's precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.engine.model.arch.config import ArchConfig
from app.engine.model.attention import PagedAttention
from app.engine.model.cpu_linear import FastLinear, LayerLinears, linear
from app.engine.model.cpu_ops import CpuOps, LayerWeights
from app.engine.model.rope import Rope, apply_rope
from app.engine.model.step_inputs import Step


@dataclass
class Kernels:
    """What the runner sets up for a decoder: fast linears, fused projections, C++ ops, attention."""

    attention: PagedAttention
    ops: CpuOps
    packed: dict[nn.Module, FastLinear]
    fused_qkv: list[nn.Module | None]
    fused_gate_up: list[nn.Module | None]
    act_dtype: torch.dtype
    rms: dict[nn.Module, tuple[torch.Tensor, float]]  # ``Decoder.rms_params``


class Decoder:
    """The Llama layer: RMSNorm, q/k/v, RoPE, attention, o; RMSNorm, ``down(act(gate) * up)``."""

    def __init__(self, model: nn.Module, config: ArchConfig) -> None:
        self.model, self.config = model, config
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.ropes = {name: Rope(spec) for name, spec in config.ropes.items()}
        self.windows = config.windows
        attn = self.layers[0].self_attn
        # NOTE: local head counts come from the (possibly sharded) weights, never from the config.
        self.num_heads, self.num_kv_heads = self.local_heads(attn)
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.k: Kernels | None = None

    # -- set-up ------------------------------------------------------------------------------
    def local_heads(self, attn: nn.Module) -> tuple[int, int]:
        d = self.config.head_dim
        return attn.q_proj.weight.shape[0] // d, attn.k_proj.weight.shape[0] // d

    def linear_groups(self) -> list[LayerLinears]:
        out = []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            out.append(LayerLinears([a.q_proj, a.k_proj, a.v_proj], a.o_proj, [mlp.gate_proj, mlp.up_proj], mlp.down_proj))
        return out

    def norm_weight(self, norm: nn.Module) -> torch.Tensor | None:
        """The float32 weight ``x_normed * w`` multiplies by, for the fused add + RMSNorm; None where
        this norm is not an RMSNorm of that form."""
        w = getattr(norm, "weight", None)
        if "RMSNorm" not in type(norm).__name__ or w is None or w.dtype != torch.float32:
            return None
        return w

    def rms_params(self) -> dict[nn.Module, tuple[torch.Tensor, float]]:
        """(weight, eps) of each norm the fused add + RMSNorm may run."""
        out = {}
        for norm in self.model.modules():
            eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
            w = self.norm_weight(norm)
            if w is not None and eps is not None:
                out[norm] = (w, float(eps))
        return out

    def fused_layer_weights(self, fused_qkv: list, fused_gate_up: list, rms: dict) -> list[LayerWeights] | None:
        """Each layer's ``decode_layer`` arguments where this family's layers are ones it runs."""
        return None

    def bind(self, kernels: Kernels) -> None:
        self.k = kernels
        self._rms = kernels.rms

    # -- pieces ------------------------------------------------------------------------------
    def linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return linear(module, x, self.k.packed.get(module))

    def add_norm(self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, norm(h + delta))`` (``delta`` None: nothing added). A float32 RMSNorm on a CPU
        is one C++ op that adds in place (``csrc/rms_norm.cpp``), or torch's ``rms_norm``; any other
        norm runs its forward."""
        params = self._rms.get(norm)
        if params is None or h.dtype != torch.float32:
            h = h if delta is None else h + delta
            return h, norm(h)
        w, eps = params
        op = self.k.ops.add_rms_norm
        if op is not None and h.is_contiguous() and (delta is None or delta.is_contiguous()):
            return h, op(h, delta, w, eps)
        h = h if delta is None else h + delta
        return h, F.rms_norm(h, w.shape, w, eps)

    def rms(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` over the last axis (e.g. per-head q/k norms), in float32 where it can."""
        params = self._rms.get(norm)
        if params is None or x.dtype != torch.float32:
            return norm(x)
        w, eps = params
        return F.rms_norm(x, w.shape, w, eps)

    def qkv_of(self, i: int) -> nn.Module | None:
        """Layer ``i``'s q, k and v as one linear, or None (three of them)."""
        return self.k.fused_qkv[i]

    def gate_up_of(self, i: int) -> nn.Module | None:
        """Layer ``i``'s gate and up as one linear (gate first), or None (two of them)."""
        return self.k.fused_gate_up[i]

    def activation(self, i: int) -> nn.Module:
        return self.layers[i].mlp.act_fn

    def projections(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k and v ``[T, KVH, D]`` of layer ``i``, before RoPE."""
        T, d = x.shape[0], self.head_dim
        qkv = self.qkv_of(i)
        if qkv is not None:
            out = self.linear(qkv, x)
            nq, nk = self.num_heads * d, self.num_kv_heads * d
            return (out[:, :nq].view(T, self.num_heads, d), out[:, nq:nq + nk].view(T, self.num_kv_heads, d),
                    out[:, nq + nk:].view(T, self.num_kv_heads, d))
        a = self.layers[i].self_attn
        return (self.linear(a.q_proj, x).view(T, self.num_heads, d), self.linear(a.k_proj, x).view(T, self.num_kv_heads, d),
                self.linear(a.v_proj, x).view(T, self.num_kv_heads, d))

    def qk_norm(self, i: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def rope_of(self, i: int) -> str:
        return self.config.layer_rope[i]

    def attention(self, i: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Layer ``i``'s attention of the normed ``x`` -> ``[T, H*D]`` (before o); stores the K/V."""
        cos, sin = step.rope[self.rope_of(i)]
        window = self.config.layer_window[i]
        qkv = self.k.fused_qkv[i]
        rope_store = self.k.ops.rope_store
        if (qkv is not None and rope_store is not None and type(self).qk_norm is Decoder.qk_norm
                and cos.shape[-1] == self.head_dim and x.dtype == torch.float32):
            # RoPE of q and k and the K/V store in one C++ call on the fused output
            T = x.shape[0]
            out = self.linear(qkv, x)
            nq = self.num_heads + self.num_kv_heads
            v = out[:, nq * self.head_dim:].view(T, self.num_kv_heads, self.head_dim)
            kv = self.k.attention
            qk = rope_store(out, cos.view(T, -1), sin.view(T, -1), step.slots, kv.k_cache[i], kv.v_cache[i],
                            self.num_heads, self.num_kv_heads)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        else:
            q, k, v = self.projections(i, x)
            q, k = self.qk_norm(i, q, k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.k.attention.store(i, k, v, step)
        return self.k.attention.attend(i, q, k, v, step, self.scale, window)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        mlp, act_fn = self.layers[i].mlp, self.activation(i)
        if (gu := self.gate_up_of(i)) is not None:
            gate_up = self.linear(gu, x)
            if self.k.ops.silu_mul is not None and type(act_fn) is nn.SiLU and gate_up.is_contiguous():
                act = self.k.ops.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=1)
                act = act_fn(gate) * up
        else:
            act = act_fn(self.linear(mlp.gate_proj, x)) * self.linear(mlp.up_proj, x)
        return self.linear(mlp.down_proj, act)

    def after_attention(self, i: int, h: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From layer ``i``'s attention output (before o) to what it adds to the residual."""
        layer = self.layers[i]
        h, x = self.add_norm(layer.post_attention_layernorm, h, self.linear(layer.self_attn.o_proj, o))
        return h, self.mlp(i, x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids).to(self.k.act_dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if type(self.lm_head) is nn.Linear:
            return self.linear(self.lm_head, h)
        # NOTE: [1, S, hidden]: DeepSpeed's sharded LM head slices its input as a 3-D tensor.
        return self.lm_head(h[None].to(self.lm_head.weight.dtype))[0].to(self.k.act_dtype)

    # -- forward -----------------------------------------------------------------------------
    def fused_step(self, step: Step) -> bool:
        return False

    def fused_layer(self, i: int, h: torch.Tensor, delta: torch.Tensor | None, step: Step) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, step: Step) -> torch.Tensor:
        """Runs all layers over the packed step; returns logits ``[len(sample_rows), vocab]``."""
        T = step.input_ids.shape[0]
        h = self.embed(step.input_ids)  # [T, hidden]
        last = len(self.layers) - 1
        delta = None  # a sublayer's output, added to h where the next norm reads it
        fused = self.fused_step(step)
        all_sampled = step.sample_rows.numel() == T  # the last layer needs no row selection
        for i, layer in enumerate(self.layers):
            if fused and (i != last or all_sampled):
                delta = self.fused_layer(i, h, delta, step)
                continue
            h, x = self.add_norm(layer.input_layernorm, h, delta)
            o = self.attention(i, x, step)
            if i == last:
                # NOTE: only the sampled rows feed the logits; skip the rest of the last layer for them.
                if step.sample_rows.numel() == 0:  # same decision on every TP rank
                    return h.new_empty(0, self.config.vocab_size)
                o = o.index_select(0, step.sample_rows)
                h = h.index_select(0, step.sample_rows)
            h, delta = self.after_attention(i, h, o)
        _, h = self.add_norm(self.norm, h, delta)
        return self.logits(h)
