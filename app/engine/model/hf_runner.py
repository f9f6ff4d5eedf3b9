"""HFRunner: a Llama-family Hugging Face causal LM with its KV cache in the paged pool.

The forward is our own, built from the HF model's modules (embeddings, norms, projections, MLP,
rotary embedding). All tokens of a step are packed into one ``[T, hidden]`` tensor for the linear
layers; attention reads and writes the preallocated pool
``k_cache/v_cache: [num_layers, num_blocks, block_size, local_kv_heads, head_dim]``. Decode rows
attend through foreserve's C++ kernel, which reads each sequence's blocks in place
(``cpu_kernels.py``; float32 or bfloat16 KV), or else by gathering the blocks and calling SDPA.
On a CPU the activations are float32 whatever the weights' dtype: bfloat16 weights halve the bytes a
step streams (``cpu_linear.fast_linear``), and norms, softmax and sums keep float32's precision.
Head counts are read from the projection weights, so the same forward runs on DeepSpeed AutoTP
shards (see ``app/engine/parallel/tp.py``), whose row-parallel layers all-reduce inside their forward.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from app.config import EngineConfig
from app.engine.model.cpu_linear import FastLinear, bf16_kernel_rows, linear, pack_layers, warm_up
from app.engine.model.cpu_ops import CpuOps, cpu_ops, rms_norm_params, takes_fused_layers
from app.engine.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from app.engine.runner import Runner
from app.engine.model.sampler import Sampler
from app.engine.model.setup import resolve_device, torch_dtype
from app.engine.model.step_inputs import Step, build_step


def _is_plain_gated_mlp(mlp: torch.nn.Module) -> bool:
    """Llama's ``down(act(gate(x)) * up(x))`` with plain ``nn.Linear`` projections."""
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return hasattr(mlp, "act_fn") and all(type(p) is torch.nn.Linear for p in parts)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotate-half RoPE on ``[T, heads, head_dim]`` with ``cos/sin: [T, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class HFRunner(Runner):
    """Runs the model in this process. ``model`` lets a caller pass an already built (e.g. sharded) one."""

    def __init__(self, config: EngineConfig, num_blocks: int, model: torch.nn.Module | None = None,
                 with_tokenizer: bool = True) -> None:
        from app.engine.model.llama import load_model
        from app.engine.text.tokenizer import load_tokenizer

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        # NOTE: OpenMP's thread count is per calling thread: a step run from another thread (the
        # async engine's, a Ray Data actor's UDF thread) would fall back to OMP_NUM_THREADS, which
        # Ray sets to an actor's CPU count (1 for fractional CPUs): 35% fewer tokens/s, measured
        self.threads = torch.get_num_threads()
        self.config = config
        self.dtype = torch_dtype(config.weights_dtype)
        self.block_size = config.block_size_tokens
        self.num_blocks = num_blocks
        if model is None:
            self.device = resolve_device(config.device)
            model = load_model(config.model_path, config.model_impl, self.dtype, self.device)
        else:  # an already placed (e.g. sharded) model
            self.device = next(model.parameters()).device
        self.model = model.eval().requires_grad_(False)
        # NOTE: float32 activations on a CPU (bfloat16 weights are widened as they are read); the
        # weights' dtype elsewhere
        self.act_dtype = torch.float32 if self.device.type == "cpu" and self.dtype == torch.bfloat16 else self.dtype
        if self.act_dtype != self.dtype:
            for module in self.model.modules():  # norms: a few KB, read every layer in float32
                if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                    module.to(self.act_dtype)
        self.tokenizer = load_tokenizer(config.model_path) if with_tokenizer else None
        eos = self.model.config.eos_token_id
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos

        inner = self.model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = self.model.lm_head
        # NOTE: decided once: plain Llama-style layers go through ``linear``; TP-sharded ones
        # (DeepSpeed's modules, which all-reduce inside) run their own forward.
        self.plain_mlp = all(_is_plain_gated_mlp(layer.mlp) for layer in self.layers)
        self.plain_lm_head = type(self.lm_head) is torch.nn.Linear
        self._rms_params = rms_norm_params(self.model)  # read once here rather than on every call
        # ``fast_linear``'s functions by module (a module missing runs the plain path), and per layer
        # q, k, v and gate, up fused into one linear each (None where unfused)
        self.packed: dict[torch.nn.Module, FastLinear] = {}
        self.fused_qkv: list[torch.nn.Linear | None] = [None] * len(self.layers)
        self.fused_gate_up: list[torch.nn.Linear | None] = [None] * len(self.layers)
        bf16_op = bf16_pack = None
        bf16w_rows = bf16_kernel_rows() if self.dtype == torch.bfloat16 and self.device.type == "cpu" else 0
        if config.cpu_prepacked_linears:
            if bf16w_rows:
                from app.engine.model.cpu_kernels import bf16_linear_op, bf16_pack_op

                bf16_op, bf16_pack = bf16_linear_op(), bf16_pack_op()
            self.packed, self.fused_qkv, self.fused_gate_up = pack_layers(
                self.layers, self.lm_head, self.plain_mlp, bf16_op, bf16_pack)
            steps, sampled = config.max_num_batched_tokens, min(config.max_num_batched_tokens, config.max_num_seqs)
            warm_up(self.packed, lambda m: sampled if m is self.lm_head else steps)
        attn = self.layers[0].self_attn
        hf = self.model.config
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # NOTE: local head counts come from the (possibly sharded) weights, never from the config.
        self.num_heads = attn.q_proj.weight.shape[0] // self.head_dim
        self.num_kv_heads = attn.k_proj.weight.shape[0] // self.head_dim
        self.num_rep = self.num_heads // self.num_kv_heads
        self.scale = getattr(attn, "scaling", self.head_dim**-0.5)
        self.qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        self.vocab_size = hf.vocab_size
        shape = (len(self.layers), num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_dtype = torch_dtype(config.cache_dtype)
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.sampler = Sampler(config.seed)
        # NOTE: reused gather buffers; a fresh multi-MB tensor per layer costs page faults every step.
        self._kbuf = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        self._vbuf = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        self.ops = CpuOps()
        if config.cpu_paged_attention and self.device.type == "cpu" and self.act_dtype == torch.float32 \
                and self.kv_dtype in (torch.float32, torch.bfloat16):
            self.ops = cpu_ops(self.layers, self.fused_qkv, self.fused_gate_up, self.plain_mlp, self._rms_params,
                               bf16w_rows=bf16w_rows if bf16_op is not None else 0, fast=self.packed)

    @staticmethod
    def kv_bytes_per_token(hf_config, dtype: str | torch.dtype) -> int:
        """K + V bytes one token takes over all layers (whole model, all ranks together)."""
        from app.engine.model.llama import kv_bytes_per_token

        return kv_bytes_per_token(hf_config, torch_dtype(dtype))

    # -- step --------------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput, sample: bool = True) -> ModelRunnerOutput:
        """Run one step. ``sample=False`` (TP ranks other than 0) runs the forward only."""
        t0 = time.perf_counter()
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        self.sampler.drop(scheduler_output.finished_request_ids)
        sampled: dict[str, int] = {}
        if scheduler_output.chunks:
            with torch.inference_mode():
                # NOTE: the step's small index tensors are made on the runner's device. Only here: a
                # device context sends every torch call through a Python mode (microseconds each,
                # ~750 calls in a forward), so the forward and the sampler name devices themselves.
                with torch.device(self.device):
                    step = self._prepare(scheduler_output.chunks)
                logits = self._forward(step)
                if sample and step.sample_chunks:
                    cs = step.sample_chunks
                    tokens = self.sampler.sample(logits, [c.request_id for c in cs], [c.sampling for c in cs],
                                                 [c.num_output_tokens for c in cs])
                    sampled = {c.request_id: t for c, t in zip(cs, tokens)}
        return ModelRunnerOutput(sampled_token_ids=sampled, step_s=time.perf_counter() - t0)

    def _prepare(self, chunks: list[ScheduledChunk]) -> Step:
        # a step the fused layers take runs its prompt chunks as decode rows (``build_step``)
        return build_step(chunks, self.block_size, self.rotary, self.k_cache, self.act_dtype,
                          paged=self.ops.paged_decode is not None,
                          paged_rows=self.ops.fused_rows if self.ops.decode_layer is not None else 0)

    def _forward(self, step: Step) -> torch.Tensor:
        """Runs all layers over the packed step; returns logits ``[len(sample_rows), vocab]``."""
        T = step.input_ids.shape[0]
        h = self.embed(step.input_ids).to(self.act_dtype)  # [T, hidden]
        last = len(self.layers) - 1
        pk = self.packed.get
        delta = None  # a sublayer's output, added to h where the next norm reads it
        fused = self.ops.decode_layer is not None and takes_fused_layers(step, self.ops.fused_rows)
        if fused:
            cos, sin = step.cos.view(T, -1), step.sin.view(T, -1)
            fused_last = step.sample_rows.numel() == T  # all rows sampled: the last layer needs no row selection
        for i, layer in enumerate(self.layers):
            if fused and (i != last or fused_last):
                delta = self.ops.decode_layer(h, delta, *self.ops.layer_weights[i], cos, sin, step.slots, self.k_cache[i],
                                              self.v_cache[i], step.decode_tables, step.decode_lens, self.num_heads,
                                              self.num_kv_heads, self.scale, self.ops.layer_packed[i])
                continue
            attn = layer.self_attn
            h, x = self._add_norm(layer.input_layernorm, h, delta)
            kc = self.k_cache[i]
            vc = self.v_cache[i]
            stored = False
            qkv = self.fused_qkv[i]
            if qkv is not None and not self.qk_norm:
                # q and k rotated in one go: heads [0, H + KVH) of the fused output
                out = linear(qkv, x, pk(qkv))
                nq = self.num_heads + self.num_kv_heads
                v = out[:, nq * self.head_dim:].view(T, self.num_kv_heads, self.head_dim)
                if self.ops.rope_store is not None and out.dtype == torch.float32:
                    qk = self.ops.rope_store(out, step.cos.view(T, -1), step.sin.view(T, -1), step.slots, kc, vc,
                                         self.num_heads, self.num_kv_heads)
                    stored = True
                else:
                    qk = _rope(out[:, : nq * self.head_dim].view(T, nq, self.head_dim), step.cos, step.sin)
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
            else:
                q = linear(attn.q_proj, x, pk(attn.q_proj)).view(T, self.num_heads, self.head_dim)
                k = linear(attn.k_proj, x, pk(attn.k_proj)).view(T, self.num_kv_heads, self.head_dim)
                v = linear(attn.v_proj, x, pk(attn.v_proj)).view(T, self.num_kv_heads, self.head_dim)
                if self.qk_norm:  # Qwen3-style per-head norms before RoPE
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q = _rope(q, step.cos, step.sin)
                k = _rope(k, step.cos, step.sin)
            if not stored:
                flat = (-1, self.num_kv_heads, self.head_dim)
                kc.view(flat).index_copy_(0, step.slots, k.to(self.kv_dtype))
                vc.view(flat).index_copy_(0, step.slots, v.to(self.kv_dtype))
            o = self._attention(q, k, v, kc, vc, step)
            if i == last:
                # NOTE: only the sampled rows feed the logits; skip the rest of the last layer for them.
                if step.sample_rows.numel() == 0:  # same decision on every TP rank
                    return h.new_empty(0, self.vocab_size)
                o = o.index_select(0, step.sample_rows)
                h = h.index_select(0, step.sample_rows)
            h, x = self._add_norm(layer.post_attention_layernorm, h, linear(attn.o_proj, o, pk(attn.o_proj)))
            if self.plain_mlp:
                mlp = layer.mlp
                if (gu := self.fused_gate_up[i]) is not None:
                    gate_up = linear(gu, x, pk(gu))
                    if self.ops.silu_mul is not None and gate_up.is_contiguous():
                        act = self.ops.silu_mul(gate_up)
                    else:
                        gate, up = gate_up.chunk(2, dim=1)
                        act = mlp.act_fn(gate) * up
                else:
                    act = mlp.act_fn(linear(mlp.gate_proj, x, pk(mlp.gate_proj))) * linear(mlp.up_proj, x, pk(mlp.up_proj))
                delta = linear(mlp.down_proj, act, pk(mlp.down_proj))
            else:
                delta = layer.mlp(x.to(self.dtype)).to(self.act_dtype)
        _, h = self._add_norm(self.norm, h, delta)
        if self.plain_lm_head:
            return linear(self.lm_head, h, self.packed.get(self.lm_head))
        # NOTE: [1, S, hidden]: DeepSpeed's sharded LM head slices its input as a 3-D tensor.
        return self.lm_head(h[None].to(self.dtype))[0].to(self.act_dtype)

    def _add_norm(self, norm: torch.nn.Module, h: torch.Tensor,
                  delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, norm(h + delta))`` (``delta`` None: nothing added). A float32 RMSNorm on a CPU
        is one C++ op that adds in place (``csrc/rms_norm.cpp``; ~35 us a call less than torch's
        chain of small ops at one row), or torch's ``rms_norm``; any other norm runs its forward."""
        params = self._rms_params.get(norm)
        if params is None or h.dtype != torch.float32:
            h = h if delta is None else h + delta
            return h, norm(h)
        w, eps = params
        if self.ops.add_rms_norm is not None and h.is_contiguous() and (delta is None or delta.is_contiguous()):
            return h, self.ops.add_rms_norm(h, delta, w, eps)
        h = h if delta is None else h + delta
        return h, F.rms_norm(h, w.shape, w, eps)

    def _attention(self, q, k, v, kc, vc, step: Step) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, KVH, D]`` of this step, kc/vc one layer of the pool -> ``[T, H*D]``."""
        T = q.shape[0]
        kvh, hd, rep = self.num_kv_heads, self.head_dim, self.num_rep
        out = q.new_empty(T, self.num_heads, hd)
        if step.decode_tables is not None:
            nd = step.num_decode
            out[:nd] = self.ops.paged_decode(q[:nd].contiguous(), kc, vc, step.decode_tables, step.decode_lens, self.scale)
        for g in step.decode:
            # Grouped heads as the query axis: q [n, KVH, rep, D] against K [n, KVH, L, D], one SDPA.
            n = g.end - g.start
            kk, vv = self._gather(kc, vc, g.blocks)
            kk = kk.view(n, -1, kvh, hd).transpose(1, 2)
            vv = vv.view(n, -1, kvh, hd).transpose(1, 2)
            qd = q[g.start:g.end].view(n, kvh, rep, hd).to(self.kv_dtype)
            od = F.scaled_dot_product_attention(qd, kk, vv, attn_mask=g.mask, scale=self.scale)
            out[g.start:g.end] = od.reshape(n, self.num_heads, hd)  # NOTE: back to the model's dtype
        for p in step.prefills:
            qs = q[p.start:p.end].transpose(0, 1)[None]
            if p.block_ids is None:
                ks = k[p.start:p.end].transpose(0, 1)[None]
                vs = v[p.start:p.end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                ks, vs = self._gather(kc, vc, p.block_ids)
                ks = ks.view(-1, kvh, hd)[: p.ctx_tokens].transpose(0, 1)[None]
                vs = vs.view(-1, kvh, hd)[: p.ctx_tokens].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs.to(self.kv_dtype), ks, vs, attn_mask=p.mask, scale=self.scale,
                                                   enable_gqa=True)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out.view(T, self.num_heads * hd)

    def _gather(self, kc: torch.Tensor, vc: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies the named blocks of one layer into the reused buffers: ``[len(blocks), block, KVH, D]``."""
        shape = (blocks.shape[0], *kc.shape[1:])
        numel = shape[0] * kc[0].numel()
        if self._kbuf.numel() < numel:
            self._kbuf = torch.empty(numel, dtype=self.kv_dtype, device=self.device)
            self._vbuf = torch.empty(numel, dtype=self.kv_dtype, device=self.device)
        kout = self._kbuf[:numel].view(shape)
        vout = self._vbuf[:numel].view(shape)
        torch.index_select(kc, 0, blocks, out=kout)
        torch.index_select(vc, 0, blocks, out=vout)
        return kout, vout

    def shutdown(self) -> None:
        """Nothing to release in-process; kept for the Runner contract."""
