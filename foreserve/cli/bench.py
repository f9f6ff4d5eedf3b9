"""`foreserve bench throughput|predictor|serve|batch|burst`: the benchmarks, each writing a JSON report."""

from __future__ import annotations

import argparse
import json
import os

from app.runtime_env import step_trace_folder
from foreserve.cli.common import write_json

POLICY_CHOICES = ("reserve_max", "paged", "reserve_predicted", "oracle", "hf_static", "hf_continuous",
                  "llama_cpp_bf16", "llama_cpp_f32", "llama_cpp_q4_1")
PEER_PREFIXES = ("hf_", "llama_cpp_")


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICY_CHOICES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {bad or text!r}; choose from {', '.join(POLICY_CHOICES)}")
    return names


def _trace_folder(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"a file, not a folder: {text!r}")
    return text


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from loadtests.bench.report import print_table
    from loadtests.bench.throughput import run_benchmark

    if args.sim and any(p.startswith(PEER_PREFIXES) for p in args.policies):
        raise SystemExit("error: the hf_* and llama_cpp_* peers run the real model; drop them from --policies with --sim")
    report = run_benchmark(
        policies=args.policies,
        num_requests=args.requests,
        kv_tokens=args.kv_tokens,
        max_tokens=args.max_tokens,
        predictor=args.predictor,
        bound_quantile=args.bound_quantile,
        sim=args.sim,
        tp=args.tp,
        repeats=args.repeats,
        scheduler=args.scheduler,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        step_trace_dir=args.step_trace,
    )
    print_table(report)
    return write_json(args.json, report)


def cmd_bench_predictor(args: argparse.Namespace) -> int:
    from loadtests.bench.predictor_speed import run

    report = run(args.version, args.prompts, args.threads)
    for row in report["results"]:
        print(f"batch {row['batch_size']:>3}: {row['prompts_per_s']:>7} prompts/s ({row['ms_per_batch']} ms per batch)")
    return write_json(args.json, report)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from loadtests.bench.serve_overhead import print_report, run

    report = run(args.requests, args.max_tokens, args.config)
    print_report(report)
    return write_json(args.json, report)


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from loadtests.bench.batch_job import run_batch_bench

    report = run_batch_bench(args.rows, args.max_tokens, args.kv_tokens, args.predictor, args.repeats, not args.no_kill)
    print(json.dumps(report, indent=2))
    return write_json(args.json, report)


def cmd_bench_feedback(args: argparse.Namespace) -> int:
    from app import paths
    from loadtests.bench.feedback_store import print_report, run

    report = run(args.store or [paths.store().uri], args.records)
    print_report(report)
    if args.json:
        write_json(args.json, report)
    return 0


def cmd_bench_burst(args: argparse.Namespace) -> int:
    from loadtests.bench.burst import run

    report = run(args.requests, args.flex, args.max_tokens, args.config, args.ttft_slo_ms, args.calm_s,
                 late_flex_requests=args.late_flex)
    print(json.dumps(report, indent=2))
    return write_json(args.json, report)


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    b = bench.add_parser(
        "throughput",
        help="offline replay of the ShareGPT validation trace, all policies side by side",
        description="Replays the validation trace with every request forced to its true length, "
        "each policy (and peer) on the same requests and KV budget; prints a table and writes JSON.",
    )
    b.add_argument("--policies", type=_policies, default=_policies("reserve_max,paged,reserve_predicted,oracle"),
                   help=f"comma-separated, from: {', '.join(POLICY_CHOICES)} (llama_cpp_*: llama-server on the "
                   "same requests and KV budget, the best of 4, 8 and 16 slots; `make llama-cpp` builds it)")
    b.add_argument("--requests", type=int, default=32, help="requests replayed (default 32)")
    b.add_argument("--kv-tokens", type=int, default=4096, help="KV pool size in tokens (ignored with --sim)")
    b.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of every request (default 1024)")
    b.add_argument("--predictor", default="oracle",
                   help="oracle | max | champion (the MLflow alias) | a registry version | a model directory; "
                   "NAME:Q sets the bound quantile; a comma list (champion,champion:0.9,oracle) adds a "
                   "reserve_predicted@NAME row per further predictor, side by side")
    b.add_argument("--bound-quantile", type=float,
                   help="learned predictor: reserve up to this quantile of the predicted length distribution "
                   "(default: the engine's bound_quantile, 0.7)")
    b.add_argument("--sim", metavar="HARDWARE:MODEL", help="simulated runner, e.g. H100-80G:llama-3-70b")
    b.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights dtype of the real model (auto: bfloat16 on a CPU with native bfloat16, else float32)")
    b.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="KV cache dtype of the real model (auto: the weights')")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    b.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help="per-step token budget (chunked prefill); default 512, or 8192 with --sim")
    b.add_argument("--repeats", type=int, default=1, help="repeat runs (interleaved); medians are reported")
    b.add_argument("--scheduler", choices=("fcfs", "offline", "online"),
                   help="override the scheduler (default: fcfs for reserve_max/paged, offline for the others)")
    b.add_argument("--step-trace", metavar="DIR", type=_trace_folder, default=step_trace_folder(),
                   help="write each engine row's step trace (one JSON line a step) into DIR/<repeat>-<row>/ "
                   "(default: $FORESERVE_STEP_TRACE)")
    b.add_argument("--json", metavar="FILE", help="write the benchmark JSON here")
    b.set_defaults(func=cmd_bench_throughput)
    bp = bench.add_parser("predictor", help="length predictor inference speed: prompts/s at batch 1 and 32")
    bp.add_argument("--version", default="champion", help="champion, a registry version or a model directory")
    bp.add_argument("--prompts", type=int, default=256, help="validation prompts to time (default 256)")
    bp.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    bp.add_argument("--json", metavar="FILE")
    bp.set_defaults(func=cmd_bench_predictor)

    bs = bench.add_parser(
        "serve", help="serving overhead: startup time, HTTP TTFT vs engine TTFT, streaming delivery",
        description="Starts the app on a free port and sends one streaming request at a time; the engine "
        "replica reports when it received the request and emitted each token, so HTTP TTFT minus engine TTFT "
        "is what serving adds, and the spread ratio shows tokens arrive as they are generated.")
    bs.add_argument("--requests", type=int, default=20, help="sequential requests timed (default 20)")
    bs.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    bs.add_argument("--config", help="Serve config file (default: the repository's serve_config.yaml)")
    bs.add_argument("--json", metavar="FILE")
    bs.set_defaults(func=cmd_bench_serve)

    bb = bench.add_parser(
        "batch", help="a batch job (Ray Jobs + Ray Data) vs bench throughput on the same rows, plus a killed-actor run",
        description="The first N validation rows, each at its true length capped at --max-tokens (ignore_eos), run "
        "alternately by bench throughput's reserve_predicted engine and by a batch job with one engine actor of the "
        "same KV budget and threads; medians and their ratio. A last job has its engine actor killed halfway and must "
        "answer every row once. Uses the running local Ray cluster, or starts one and stops it after.")
    bb.add_argument("--rows", type=int, default=64, help="rows (default 64)")
    bb.add_argument("--max-tokens", type=int, default=256, help="cap on each row's true length (default 256)")
    bb.add_argument("--kv-tokens", type=int, default=8192, help="KV pool of the engine, both sides (default 8192)")
    bb.add_argument("--predictor", default="champion", help="champion (default), max, a registry version or a model directory")
    bb.add_argument("--repeats", type=int, default=1, help="alternating repeats; medians are reported")
    bb.add_argument("--no-kill", action="store_true", help="skip the killed-actor run")
    bb.add_argument("--json", metavar="FILE")
    bb.set_defaults(func=cmd_bench_batch)

    bf = bench.add_parser(
        "feedback", help="what recording feedback costs the engine's path: append latency, synchronous vs background flush",
        description="Times each finished request's feedback append where the engine calls it: one durable put per "
        "request, and the background flush serving uses; per store (a folder, file://, s3://...?endpoint_override=...).")
    bf.add_argument("--store", action="append", metavar="URI", help="a store to measure (repeatable; default: the configured one)")
    bf.add_argument("--records", type=int, default=500, help="finished requests to record per store and mode")
    bf.add_argument("--json", metavar="FILE", help="write the report JSON here")
    bf.set_defaults(func=cmd_bench_feedback)
    bu = bench.add_parser(
        "burst", help="elasticity on the real app: an online burst makes the offline pool yield, then come back",
        description="Starts the app (serve_config.yaml, or --config) on a free port, waits for the offline replica, "
        "sends a burst of online requests (and a few flex ones) and times how fast the offline pool gives up its "
        "replica and how fast it is back after the burst, and checks that flex requests arriving meanwhile do not wake it; "
        "lists the autoscaler's decisions with their reasons.")
    bu.add_argument("--requests", type=int, default=16, help="online requests sent at once (default 16)")
    bu.add_argument("--flex", type=int, default=2, help="flex (offline) requests sent with them (default 2)")
    bu.add_argument("--late-flex", type=int, default=2,
                    help="flex requests sent once the offline pool has yielded: they wait at the ingress (default 2)")
    bu.add_argument("--max-tokens", type=int, default=64, help="max_tokens of the online requests (default 64)")
    bu.add_argument("--ttft-slo-ms", type=float, default=1000, help="online TTFT SLO for the run (default 1000)")
    bu.add_argument("--calm-s", type=float, default=5, help="the policy's calm_s for the run (default 5)")
    bu.add_argument("--config", help="Serve config file (default: the repository's serve_config.yaml)")
    bu.add_argument("--json", metavar="FILE")
    bu.set_defaults(func=cmd_bench_burst)
