"""The attention backend: a step's K/V stored into the paged pool, and attention over it.

The pool is ``k_cache/v_cache: [num_layers, num_blocks, block_size, local_kv_heads, head_dim]``.
Decode rows attend through foreserve's C++ kernel, which reads each sequence's blocks in place
(``cpu_kernels.py``; float32 or bfloat16 KV), or else by gathering the blocks and calling SDPA;
prompt chunks attend through SDPA. A layer with a sliding window attends to its last ``window``
positions only (``Step.windows``); its KV is kept whole, so the reservation counts every position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from app.engine.model.step_inputs import Step


class PagedAttention:
    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                 paged_decode: Callable | None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.kv_dtype = k_cache.dtype
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = k_cache.shape[-2], k_cache.shape[-1]
        self.paged_decode = paged_decode
        # NOTE: reused gather buffers; a fresh multi-MB tensor per layer costs page faults every step.
        self._kbuf = torch.empty(0, dtype=self.kv_dtype, device=k_cache.device)
        self._vbuf = torch.empty(0, dtype=self.kv_dtype, device=k_cache.device)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """k, v ``[T, KVH, D]`` into the step's slots of layer ``layer``."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.k_cache[layer].view(flat).index_copy_(0, step.slots, k.to(self.kv_dtype))
        self.v_cache[layer].view(flat).index_copy_(0, step.slots, v.to(self.kv_dtype))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float,
               window: int | None = None) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, KVH, D]`` of this step (already stored) -> ``[T, H*D]``."""
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        T = q.shape[0]
        kvh, hd = self.num_kv_heads, self.head_dim
        rep = self.num_heads // kvh
        view = step.windows.get(window) if window is not None else None
        out = q.new_empty(T, self.num_heads, hd)
        if step.decode_tables is not None:
            nd = step.num_decode
            starts = None if view is None else view.decode_starts
            out[:nd] = self.paged_decode(q[:nd].contiguous(), kc, vc, step.decode_tables, step.decode_lens, scale, starts)
        for j, g in enumerate(step.decode):
            # Grouped heads as the query axis: q [n, KVH, rep, D] against K [n, KVH, L, D], one SDPA.
            n = g.end - g.start
            kk, vv = self._gather(kc, vc, g.blocks)
            kk = kk.view(n, -1, kvh, hd).transpose(1, 2)
            vv = vv.view(n, -1, kvh, hd).transpose(1, 2)
            qd = q[g.start:g.end].view(n, kvh, rep, hd).to(self.kv_dtype)
            mask = g.mask if view is None else view.group_masks[j]
            od = F.scaled_dot_product_attention(qd, kk, vv, attn_mask=mask, scale=scale)
            out[g.start:g.end] = od.reshape(n, self.num_heads, hd)  # NOTE: back to the model's dtype
        for j, p in enumerate(step.prefills):
            qs = q[p.start:p.end].transpose(0, 1)[None]
            mask = p.mask if view is None or view.prefill_masks[j] is None else view.prefill_masks[j]
            if p.block_ids is None:  # the chunk starts the sequence: its own K/V are all there is
                ks = k[p.start:p.end].transpose(0, 1)[None]
                vs = v[p.start:p.end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks.to(qs.dtype), vs.to(qs.dtype), attn_mask=mask,
                                                   is_causal=mask is None, scale=scale, enable_gqa=True)
            else:
                ks, vs = self._gather(kc, vc, p.block_ids)
                ks = ks.view(-1, kvh, hd)[: p.ctx_tokens].transpose(0, 1)[None]
                vs = vs.view(-1, kvh, hd)[: p.ctx_tokens].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs.to(self.kv_dtype), ks, vs, attn_mask=mask, scale=scale,
                                                   enable_gqa=True)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out.view(T, self.num_heads * hd)

    def _gather(self, kc: torch.Tensor, vc: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies the named blocks of one layer into the reused buffers: ``[len(blocks), block, KVH, D]``."""
        shape = (blocks.shape[0], *kc.shape[1:])
        numel = shape[0] * kc[0].numel()
        if self._kbuf.numel() < numel:
            self._kbuf = torch.empty(numel, dtype=self.kv_dtype, device=kc.device)
            self._vbuf = torch.empty(numel, dtype=self.kv_dtype, device=kc.device)
        kout = self._kbuf[:numel].view(shape)
        vout = self._vbuf[:numel].view(shape)
        torch.index_select(kc, 0, blocks, out=kout)
        torch.index_select(vc, 0, blocks, out=vout)
        return kout, vout
