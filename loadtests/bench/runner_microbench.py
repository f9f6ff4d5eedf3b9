"""Decode-step micro-benchmark of HFRunner (with --hf, of plain HF generate-style decoding too; with
--llama-cpp, of llama.cpp's ``llama-batched-bench`` on the same weights, side by side).

    python -m loadtests.bench.runner_microbench --batch 1 4 16 32 --context-tokens 256
    python -m loadtests.bench.runner_microbench --batch 1 8 16 --context-tokens 512 --threads 2 \
        --dtype float32 bfloat16 --prefill-tokens 512 --llama-cpp f32 bf16

Each batch decodes one token per sequence at ``--context-tokens`` cached positions (the KV is
filled with random values: the step time does not depend on what the cache holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from app.config import EngineConfig
from app.engine.model.timing import bench_prefill, bench_runner  # the timings (the CPU calibration's too)
from app.engine.request import SamplingParams
from app.runtime_env import process_defaults


def bench_hf(model, batch: int, context: int, steps: int, warmup: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(100, 1000, (batch, context))
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for s in range(warmup + steps):
            t0 = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            if s >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _runner(args, dtype: str):
    from app.engine.model.hf_runner import HFRunner

    need = max(args.batch) * -(-(args.context_tokens + args.warmup + args.steps + 1) // args.block_size)
    need = max(need, -(-2 * args.prefill_tokens // args.block_size))
    config = EngineConfig(model=args.model, kv_cache_tokens=need * args.block_size, block_size_tokens=args.block_size,
                          torch_threads=args.threads, tensor_parallel_size=args.tp,
                          cpu_paged_attention=not args.gather_attention, dtype=dtype,
                          kv_cache_dtype=args.kv_cache_dtype)
    if args.tp > 1:
        from app.engine.parallel.tp import TPRunner

        return config, TPRunner(config, need)
    runner = HFRunner(config, need)
    runner.k_cache.normal_()
    runner.v_cache.normal_()
    return config, runner


def _foreserve_rows(args, dtype: str) -> dict:
    config, runner = _runner(args, dtype)
    if args.hf and args.tp == 1:  # transformers' own model and cache (the runner runs foreserve's modules)
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32).eval()
    row: dict = {"system": f"foreserve {config.weights_dtype} (KV {config.cache_dtype})", "decode_tok_s": {}}
    try:
        threads = runner.config.torch_threads if args.tp > 1 else torch.get_num_threads()
        print(f"dtype={config.weights_dtype} kv={config.cache_dtype} "
              f"threads per rank={threads} context_tokens={args.context_tokens} tp={args.tp} "
              f"temperature={args.temperature} top_p={args.top_p}")
        for b in args.batch:
            sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0)
            ms = bench_runner(runner, b, args.context_tokens, args.steps, args.warmup, sampling)
            row["decode_tok_s"][b] = round(b / ms * 1000, 1)
            line = f"batch {b:3d}: runner {ms:8.1f} ms/step  ({b / ms * 1000:7.1f} tok/s)"
            if args.hf and args.tp == 1:
                hf_ms = bench_hf(hf_model, b, args.context_tokens, args.steps, args.warmup)
                line += f" | HF {hf_ms:8.1f} ms/step"
            print(line, flush=True)
        if args.prefill_tokens:
            n = args.prefill_tokens
            for start in (0, n):
                ms = bench_prefill(runner, n, start, max(2, args.steps // 3))
                print(f"prefill {n} tokens at position {start}: {ms:8.1f} ms  ({n / ms * 1000:7.1f} tok/s)", flush=True)
                if start == 0:
                    row["prefill_tok_s"] = round(n / ms * 1000, 1)
    finally:
        runner.shutdown()
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a HF folder or a packaged model's short name (default: the embedded one)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32], help="decode batch sizes")
    ap.add_argument("--context-tokens", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per batch size (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (TPRunner when > 1)")
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time one prefill chunk of this many tokens")
    ap.add_argument("--hf", action="store_true", help="also time plain HF decoding with DynamicCache")
    ap.add_argument("--dtype", nargs="+", choices=("auto", "float32", "bfloat16"), default=["auto"],
                    help="weights dtype(s), each its own runner (auto: bfloat16 on a CPU with native bfloat16, else float32)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="KV cache dtype (auto: the weights')")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample decode rows at this temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="top-p of sampled rows")
    ap.add_argument("--gather-attention", action="store_true",
                    help="decode attention by gather + SDPA instead of the paged C++ kernel (cpu_paged_attention off)")
    ap.add_argument("--llama-cpp", nargs="*", choices=("f32", "bf16", "q4_1", "q4_k_m"), default=[], metavar="DTYPE",
                    help="also run llama-batched-bench on the same weights in these GGUF dtypes (f32, bf16; q4_1, q4_k_m: the packaged model's own file; "
                    "`make llama-cpp` builds it) at the same context, batches and threads")
    ap.add_argument("--bf16-kernel-rows", type=int, default=None, metavar="N",
                    help="bfloat16 linears of up to N rows on foreserve's kernels, more on oneDNN's (default: this "
                         "CPU's, cpu_linear.bf16_kernel_rows; 0: none). For an A/B; AMX CPUs always take oneDNN's")
    ap.add_argument("--json", metavar="FILE", help="write the side-by-side table as JSON")
    args = ap.parse_args(argv)
    if args.bf16_kernel_rows is not None and args.bf16_kernel_rows < 0:
        ap.error("--bf16-kernel-rows must be >= 0")
    process_defaults()  # NOTE: a command of its own (offline hub), before transformers is imported
    if args.bf16_kernel_rows is not None:
        from app.engine.model import cpu_linear

        cpu_linear.BF16W_ROWS = cpu_linear.NATIVE_BF16W_ROWS = args.bf16_kernel_rows

    rows = [_foreserve_rows(args, d) for d in args.dtype]
    for dtype in args.llama_cpp:
        from loadtests.bench.llama_cpp import batched_bench

        threads = args.threads or torch.get_num_threads()
        model_dir = EngineConfig(model=args.model).model_path
        got = batched_bench(dtype, args.batch, args.context_tokens, 32, threads, model_dir)
        prefill = batched_bench(dtype, [1], args.prefill_tokens, 1, threads, model_dir)[1] if args.prefill_tokens else {}
        rows.append({"system": f"llama.cpp {dtype.upper()}", "decode_tok_s": {b: round(got[b]["decode_tok_s"], 1) for b in args.batch},
                     "prefill_tok_s": round(prefill.get("prefill_tok_s", 0.0), 1) or None})
    print_table(rows, args)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"context_tokens": args.context_tokens, "threads": args.threads, "rows": rows}, indent=2))
        print(f"wrote {out}")


def print_table(rows: list[dict], args) -> None:
    """Decode tok/s by batch and prefill tok/s, a row per system."""
    cols = [f"b{b}" for b in args.batch] + ([f"prefill {args.prefill_tokens}"] if args.prefill_tokens else [])
    print(f"\n{'system':<36}" + "".join(f"{c:>14}" for c in cols))
    for r in rows:
        cells = [r["decode_tok_s"].get(b) for b in args.batch] + ([r.get("prefill_tok_s")] if args.prefill_tokens else [])
        print(f"{r['system']:<36}" + "".join(f"{'' if c is None else c:>14}" for c in cells))


if __name__ == "__main__":
    main()
