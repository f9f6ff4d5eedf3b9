"""The bfloat16 linears of SmolLM2-135M's layers on a CPU, three ways: foreserve's dot-product
kernel (``csrc/bf16_linear.cpp``), its packed panels (``csrc/bf16_packed.cpp``) and oneDNN's
prepacked float32 copy; on a CPU with native bfloat16, oneDNN's prepacked bfloat16 weights too (the
rows cast to bfloat16 and the result back, as ``fast_linear`` runs them there). Random weights of the layers' shapes (q-k-v, o, gate-up, down), all 30
layers' worth per forward; the median of ``--reps`` forwards in ms per row count. One row goes to
the dot products whatever ``linear_bf16w`` is given (its packed column is blank there).

    python -m loadtests.bench.linear_microbench --rows 1 8 16 32 64 96 128 512 --threads 2
"""

from __future__ import annotations

import argparse

import torch

from loadtests.bench.timer import median_ms

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: q-k-v, o, gate-up, down
LAYERS = 30


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 96, 128, 512])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="forwards timed per row count (the median is printed)")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.threads < 1 or args.reps < 1:
        p.error("--rows, --threads and --reps must be >= 1")
    from app.engine.model.cpu_kernels import bf16_linear_op, bf16_pack_op
    from app.engine.model.cpu_linear import native_bf16, onednn_linear

    lin, pack = bf16_linear_op(), bf16_pack_op()
    if lin is None or pack is None:
        raise SystemExit("foreserve's CPU kernels could not be built here (see the warning above)")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g).bfloat16() for n, k in SHAPES]
    packed = [pack(w) for w in ws]
    dense = [torch.ops.mkldnn._reorder_linear_weight(w.float()) for w in ws]
    native = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] if native_bf16() else None
    flops_per_row = 2 * LAYERS * sum(n * k for n, k in SHAPES)
    print(f"{'rows':>5} {'dot ms':>9} {'packed ms':>10} {'oneDNN f32 ms':>14} {'oneDNN bf16 ms':>15} {'packed GFLOP/s':>15}")
    with torch.inference_mode():
        for m in args.rows:
            xs = [torch.randn(m, k, generator=g) for _, k in SHAPES]
            dot = median_ms(lambda: [lin(x, w) for x, w in zip(xs, ws) for _ in range(LAYERS)], args.reps)
            pan = None if m == 1 else median_ms(
                lambda: [lin(x, w, None, pw) for x, w, pw in zip(xs, ws, packed) for _ in range(LAYERS)], args.reps)
            one = median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], "")
                                      for x, d in zip(xs, dense) for _ in range(LAYERS)], args.reps)
            bf = "" if native is None else "%.2f" % median_ms(
                lambda: [onednn_linear(x.to(torch.bfloat16), d, None).float() for x, d in zip(xs, native) for _ in range(LAYERS)],
                args.reps)
            cells = ("", "") if pan is None else (f"{pan:.2f}", f"{flops_per_row * m / pan / 1e6:.1f}")
            print(f"{m:5d} {dot:9.2f} {cells[0]:>10} {one:14.2f} {bf:>15} {cells[1]:>15}")


if __name__ == "__main__":
    main()
