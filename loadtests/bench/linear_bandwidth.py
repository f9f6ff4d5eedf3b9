"""The linears of one decode step, timed alone, against a plain read of as many bytes: how near a
small batch's step is to the machine's memory bandwidth.

    python -m loadtests.bench.linear_bandwidth --rows 1 8 --threads 2

The weights are the served model's shapes (q/k/v and gate/up fused, as the runner fuses them, and
the LM head) in bfloat16, random; each linear runs as the runner runs it (``cpu_linear.linear`` with ``fast_linear``'s
function: foreserve's kernel up to ``bf16_kernel_rows()`` rows, oneDNN's bfloat16 kernels past them
on a CPU with native bfloat16 and at every row count with AMX). GB/s counts the bfloat16 bytes; past
``BF16W_ROWS`` rows a CPU without native bfloat16 reads float32 copies, twice as many.
"""

from __future__ import annotations

import argparse

import torch

from app.runtime_env import process_defaults
from loadtests.bench.timer import median_ms


def step_shapes(model_path) -> list[tuple[int, int]]:
    """(out, in) of every linear a decode step calls, in order."""
    from app.engine.model.arch import arch_config

    c = arch_config(model_path)[1]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
             (c.hidden_size, c.intermediate_size)]
    return layer * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows per linear (the decode batch)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=12, help="timed passes (median reported)")
    args = ap.parse_args(argv)
    process_defaults()
    if args.threads:
        torch.set_num_threads(args.threads)
    from app import paths
    from app.engine.model.cpu_kernels import bf16_linear_op, bf16_pack_op
    from app.engine.model.cpu_linear import bf16_kernel_rows, fast_linear, linear, native_bf16

    shapes = step_shapes(paths.model_dir())
    modules = [torch.nn.Linear(i, o, bias=False).to(torch.bfloat16).requires_grad_(False) for o, i in shapes]
    limit = bf16_kernel_rows()
    fast = [fast_linear(m, bf16_linear_op(), bf16_pack_op()) for m in modules]  # the kernels up to ``limit`` rows
    nbytes = sum(o * i * 2 for o, i in shapes)
    above = "oneDNN bfloat16" if native_bf16() else "float32 copies"
    kernel = ("oneDNN bfloat16" if not limit else f"foreserve's bfloat16 kernel up to {limit} rows, {above} above") \
        if all(fast) else "torch's plain linear"
    print(f"{len(shapes)} linears, {nbytes / 1e6:.0f} MB of bfloat16 weights, {torch.get_num_threads()} threads, {kernel}")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {i: torch.randn(rows, i) for _, i in set(shapes)}
            ms = median_ms(lambda: [linear(m, xs[i], f) for m, f, (_, i) in zip(modules, fast, shapes)], args.repeats, warmup=3)
            print(f"rows {rows:3d}: {ms:7.2f} ms a step's linears  ({nbytes / ms / 1e6:5.1f} GB/s of weights)")
        block = torch.randn(nbytes // 4)
        ms = median_ms(block.sum, args.repeats, warmup=3)
        print(f"plain read (sum of {nbytes / 1e6:.0f} MB): {ms:7.2f} ms  ({nbytes / ms / 1e6:5.1f} GB/s)")


if __name__ == "__main__":
    main()
