"""Decode attention alone (``csrc/paged_decode.cpp``): one decode step's calls over a paged KV pool,
with every layer's pool in cache (``hot``: one layer's pool 30 times) and out of it (``cold``: a pool
per layer, as a step reads them), the median of ``--reps`` steps, and the K/V bytes read per second.
The model's head shapes, random K/V, each sequence's blocks scattered over the pool.

    python -m loadtests.bench.attention_microbench --batch 1 8 16 --context-tokens 300 --threads 1
"""

from __future__ import annotations

import argparse

import torch

from loadtests.bench.timer import median_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32], help="sequences per step")
    p.add_argument("--context-tokens", type=int, default=300, help="cached tokens per sequence")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--kv-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=15, help="steps timed per batch (the median is printed)")
    args = p.parse_args(argv)
    if min(args.batch + [args.context_tokens, args.threads, args.layers, args.reps]) < 1:
        p.error("--batch, --context-tokens, --threads, --layers and --reps must be >= 1")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    from app.engine.model.cpu_kernels import paged_decode_op

    op = paged_decode_op()
    if op is None:
        raise SystemExit("foreserve's CPU kernels could not be built here (see the warning above)")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.kv_dtype)
    per_seq = -(-args.context_tokens // args.block_size)
    blocks = max(args.batch) * per_seq
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    pools = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
             for _ in range(args.layers)]
    print(f"{'batch':>5} {'hot ms':>8} {'cold ms':>8} {'cold GB/s of K/V':>17}   ({args.layers} layers, "
          f"{args.context_tokens} cached tokens, {args.threads} threads, K/V {args.kv_dtype})")
    for b in args.batch:
        tables = torch.randperm(blocks, generator=g)[:b * per_seq].view(b, per_seq).contiguous()
        lens = torch.full((b,), args.context_tokens, dtype=torch.long)
        q = torch.randn(b, args.heads, args.head_dim, generator=g)
        scale = args.head_dim ** -0.5
        hot = median_ms(lambda: [op(q, *pools[0], tables, lens, scale) for _ in pools], args.reps)
        cold = median_ms(lambda: [op(q, k, v, tables, lens, scale) for k, v in pools], args.reps)
        kv_bytes = 2 * b * args.context_tokens * args.kv_heads * args.head_dim * dtype.itemsize * args.layers
        print(f"{b:5d} {hot:8.2f} {cold:8.2f} {kv_bytes / cold / 1e6:17.1f}", flush=True)


if __name__ == "__main__":
    main()
