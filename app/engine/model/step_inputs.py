"""The index tensors of one runner step, built once from the scheduled chunks and read by every layer:
token ids, pool slots, each RoPE's angles, decode block tables (the paged kernel's, or gather + SDPA
groups), each prefill chunk's attention plan, and what a sliding window changes in them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.model.rope import Rope
from app.engine.outputs import ScheduledChunk

# Decode attention gathers each sequence's KV blocks padded to the longest context of its group, so
# decode rows are sorted by context and cut into up to this many equal groups of at least
# DECODE_GROUP_ROWS rows: one SDPA per group. 4 groups read 35% fewer bytes than one (batch 32,
# contexts 200-1200, measured here); more groups cost more calls than they save.
MAX_DECODE_GROUPS = 4
DECODE_GROUP_ROWS = 8


@dataclass(slots=True)
class PrefillPlan:
    start: int  # rows [start, end) of the packed step
    end: int
    ctx_tokens: int  # attends to positions [0, ctx_tokens)
    block_ids: torch.Tensor | None  # None: the chunk starts at position 0, attend to its own K/V
    mask: torch.Tensor | None  # [n, ctx] True = attend; None = plain causal


@dataclass(slots=True)
class DecodeGroup:
    start: int  # decode rows [start, end)
    end: int
    blocks: torch.Tensor  # [(end - start) * max_blocks] block tables padded to the group's longest context
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] True = attend


def decode_groups(ctx: list[int]) -> list[tuple[int, int]]:
    """Row ranges of decode rows sorted by ascending context ``ctx``: equal-sized groups, up to
    ``MAX_DECODE_GROUPS`` of at least ``DECODE_GROUP_ROWS`` rows."""
    n = len(ctx)
    groups = max(1, min(MAX_DECODE_GROUPS, n // DECODE_GROUP_ROWS))
    cuts = [round(g * n / groups) for g in range(groups + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass(slots=True)
class WindowView:
    """What a sliding window of ``w`` tokens (the query's own included) changes in a step's plans:
    each paged decode row's first position, each decode group's mask, each prefill plan's mask."""

    decode_starts: torch.Tensor | None  # [num_decode] (paged kernel)
    group_masks: list[torch.Tensor]  # by ``Step.decode``
    prefill_masks: list[torch.Tensor | None]  # by ``Step.prefills``; None: the plan's own mask holds


def window_view(step: "Step", w: int, positions: torch.Tensor) -> WindowView:
    """``step``'s plans for layers with a window of ``w`` tokens (``positions``: each row's)."""
    starts = None if step.decode_lens is None else (step.decode_lens - w).clamp(min=0)
    masks = []
    for g in step.decode:
        lens = positions[g.start:g.end] + 1
        pos = torch.arange(g.mask.shape[-1])
        masks.append(g.mask & (pos[None, :] >= (lens - w)[:, None])[:, None, None, :])
    prefill = []
    for p in step.prefills:
        q_pos = positions[p.start:p.end]
        if q_pos[-1] < w:  # no query reaches past the window
            prefill.append(None)
            continue
        kv = torch.arange(p.ctx_tokens)[None, :]
        prefill.append((kv <= q_pos[:, None]) & (kv > q_pos[:, None] - w))
    return WindowView(starts, masks, prefill)


@dataclass(slots=True)
class Step:
    """Index tensors for one step, built once and reused by every layer."""

    input_ids: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat pool slot of each token
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # by RoPE name: cos, sin [T, 1, rotary_dim]
    num_decode: int  # rows [0, num_decode) attend through the decode path (one-token chunks by ascending
    # context, and a folded step's prompt tokens)
    decode: list[DecodeGroup]  # the gather + SDPA path's groups; empty under the paged kernel
    decode_tables: torch.Tensor | None  # the paged kernel's [num_decode, max_blocks] block tables
    decode_lens: torch.Tensor | None  # [num_decode] tokens each decode row attends to
    prefills: list[PrefillPlan]
    sample_rows: torch.Tensor  # rows whose logits are computed
    sample_chunks: list[ScheduledChunk]
    windows: dict[int, WindowView]  # by sliding window size


def build_step(chunks: list[ScheduledChunk], bs: int, ropes: dict[str, Rope], act_dtype: torch.dtype,
               paged: bool, paged_rows: int = 0, windows: set[int] = frozenset(),
               rope_dtype: torch.dtype | None = None) -> Step:
    """The step's tensors for ``chunks`` with KV blocks of ``bs`` tokens: each of ``ropes``' angles
    (rounded to ``rope_dtype`` where given, as transformers' bfloat16 models round them, then in
    ``act_dtype``), and the plans of each sliding window in ``windows``; ``paged``: decode rows
    read the pool through the paged kernel's block tables, else through gather + SDPA groups. A paged step of at
    most ``paged_rows`` tokens runs its prompt chunks' tokens as decode rows too: the token at
    position p attends to the pool's [0, p], where the layer has stored the chunk's K/V before."""
    # NOTE: a step carrying a prompt chunk took 14 ms more than a decode-only one on one thread here
    # (SmolLM2-135M, bfloat16, AMD Zen 4; 2.9 ms a decode row, 1.1 ms a prompt token), since only
    # decode-only steps ran the fused layers (``cpu_ops.takes_fused_layers``): under a TPOT cap of
    # ~20 tokens a step, a quarter of the online pool's steps carried one.
    fold = paged and 0 < sum(len(c.token_ids) for c in chunks) <= paged_rows
    # NOTE: one-token chunks first, shortest context first, so each decode group is a slice of rows.
    decodes = sorted((c for c in chunks if len(c.token_ids) == 1 or fold), key=lambda c: c.start_pos)
    prefills = [c for c in chunks if len(c.token_ids) > 1 and not fold]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_chunks: list[ScheduledChunk] = []
    for c in decodes + prefills:
        n = len(c.token_ids)
        if c.start_pos + n > len(c.block_ids) * bs:
            raise ValueError(f"{c.request_id}: positions up to {c.start_pos + n} exceed its "
                             f"{len(c.block_ids)} blocks of {bs} tokens")
        ids.extend(c.token_ids)
        for pos in range(c.start_pos, c.start_pos + n):
            positions.append(pos)
            slots.append(c.block_ids[pos // bs] * bs + pos % bs)
        if c.sample:
            sample_rows.append(len(ids) - 1)
            sample_chunks.append(c)
    pos_t = torch.tensor(positions)
    angles = {name: rope.cos_sin(pos_t) for name, rope in ropes.items()}
    if rope_dtype is not None:
        angles = {name: (cos.to(rope_dtype), sin.to(rope_dtype)) for name, (cos, sin) in angles.items()}
    groups: list[DecodeGroup] = []
    tables = lens = None
    if paged:
        if decodes:
            rows = [(c, pos + 1) for c in decodes for pos in range(c.start_pos, c.start_pos + len(c.token_ids))]
            nb = -(-max(n for _, n in rows) // bs)  # the longest context's blocks
            tables = torch.tensor([c.block_ids[:nb] + [0] * (nb - min(nb, len(c.block_ids))) for c, _ in rows])
            lens = torch.tensor([n for _, n in rows])
    else:  # never folded: one row a chunk
        lengths = [c.start_pos + 1 for c in decodes]
        for a, b in decode_groups(lengths):
            nb = -(-lengths[b - 1] // bs)  # the group's longest context
            table = [c.block_ids[:nb] + [0] * (nb - min(nb, len(c.block_ids))) for c in decodes[a:b]]
            mask = (torch.arange(nb * bs)[None, :] < torch.tensor(lengths[a:b])[:, None])[:, None, None, :]
            groups.append(DecodeGroup(a, b, torch.tensor(table).view(-1), mask))
    num_decode = len(tables) if tables is not None else len(decodes)  # folded chunks: a row a token
    plans: list[PrefillPlan] = []
    row = num_decode
    for c in prefills:
        n = len(c.token_ids)
        ctx = c.start_pos + n
        if c.start_pos == 0:
            plans.append(PrefillPlan(row, row + n, ctx, None, None))
        else:
            blocks = torch.tensor(c.block_ids[: -(-ctx // bs)])
            q_pos = torch.arange(c.start_pos, ctx)
            mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
            plans.append(PrefillPlan(row, row + n, ctx, blocks, mask))
        row += n
    step = Step(
        input_ids=torch.tensor(ids), slots=torch.tensor(slots),
        rope={name: (cos[:, None, :].to(act_dtype), sin[:, None, :].to(act_dtype)) for name, (cos, sin) in angles.items()},
        num_decode=num_decode, decode=groups, decode_tables=tables, decode_lens=lens,
        prefills=plans, sample_rows=torch.tensor(sample_rows, dtype=torch.long), sample_chunks=sample_chunks,
        windows={},
    )
    step.windows = {w: window_view(step, w, pos_t) for w in windows}
    return step
