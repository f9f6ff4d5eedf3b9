"""``foreserve plan``: capacity planning on the engine's simulator; ``plan simulate-day``: the
elastic policy against static pools over a simulated day; ``plan calibrate-cpu``: the cost model
against measured step times of the real model on this machine; ``plan scheduler-ab``: the online
scheduler against FCFS under open-loop load, in modelled time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _write(path: str | None, report: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")


def print_plan(report: dict) -> None:
    inputs = report["inputs"]
    print(f"\n{inputs['model']} on {inputs['hardware']} (${inputs['gpu_hour_usd']}/GPU-hour): online {inputs['rate_rps']} req/s "
          f"at p99 TTFT <= {inputs['ttft_slo_ms']} ms, TPOT <= {inputs['tpot_slo_ms']} ms; "
          f"offline {inputs['offline_tokens_per_day']:.3g} tokens/day\n")
    print(f"{'pool':>8} {'policy':>17} {'TP':>3} {'replicas':>8} {'GPUs':>5} {'per replica':>14} {'$/M tokens':>10}")
    for pool, choice in report["pools"].items():
        unit = "req/s" if pool == "online" else "tok/s"
        for policy, row in choice["by_policy"].items():
            mark = " <-" if policy == choice["policy"] else ""
            print(f"{pool:>8} {policy:>17} {row['tensor_parallel_size']:>3} {row['replicas']:>8} {row['gpus']:>5} "
                  f"{row['per_replica']:>8.1f} {unit} {row['cost_per_million_tokens']:>10.4f}{mark}")


def plot_frontier(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = report["inputs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for tp in sorted({p["tensor_parallel_size"] for p in report["frontier"]}):
        pts = [p for p in report["frontier"] if p["tensor_parallel_size"] == tp]
        x = [p["output_tokens_per_s_per_gpu"] for p in pts]
        axes[0].plot(x, [p["tpot_p99_ms"] for p in pts], marker="o", label=f"TP {tp}")
        axes[1].plot(x, [p["ttft_p99_ms"] for p in pts], marker="o", label=f"TP {tp}")
    for ax, slo, name in ((axes[0], inputs["tpot_slo_ms"], "p99 TPOT (ms)"), (axes[1], inputs["ttft_slo_ms"], "p99 TTFT (ms)")):
        ax.axhline(slo, color="red", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel("output tokens/s per GPU")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{inputs['model']} on {inputs['hardware']}: latency vs throughput (reserve_predicted, simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def cmd_plan(args: argparse.Namespace) -> int:
    from autoscale.planning.planner import PlanRequest, plan

    req = PlanRequest(model=args.model, hardware=args.hardware, rate_rps=args.rate, ttft_slo_ms=args.ttft_slo_ms,
                      tpot_slo_ms=args.tpot_slo_ms, offline_tokens_per_day=args.offline_tokens_per_day,
                      max_tokens=args.max_tokens, gpu_hour_usd=args.gpu_hour_usd)
    report = plan(req, frontier=bool(args.plot))
    print_plan(report)
    if args.plot:
        plot_frontier(report, args.plot)
    _write(args.json, report)
    return 0


def plot_day(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    hours = [m / 60 for m, *_ in series]
    fig, (ax, low) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(2, 1))
    ax.stackplot(hours, [s[2] for s in series], [s[3] for s in series], labels=["online replicas", "offline replicas"], alpha=0.7)
    static = report["static_peak"]
    ax.axhline(static["online_replicas"] + static["offline_replicas"], color="black", linestyle="--", label="static pools")
    ax2 = ax.twinx()
    ax2.plot(hours, [s[1] for s in series], color="tab:red", linewidth=1, label="online req/s")
    ax.set_ylabel("replicas")
    ax2.set_ylabel("online req/s")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax.set_title(f"elastic: {report['elastic']['gpu_hours']} GPU-hours vs static {static['gpu_hours']}")
    low.plot(hours, [s[5] / 1e6 for s in series], color="tab:green", label="elastic offline backlog")
    low.set_ylabel("backlog (M tokens)")
    low.set_xlabel("hour of day")
    low.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def cmd_simulate_day(args: argparse.Namespace) -> int:
    from app.engine.sim.profiles import parse_sim_spec
    from autoscale.planning.capacity import PoolSpec, Workload
    from autoscale.planning.day import replica_model, simulate_day

    hardware, model = parse_sim_spec(f"{args.hardware}:{args.model}")
    spec = PoolSpec(hardware, model, args.tp)
    print(f"simulating one {model.name} tp={args.tp} replica on {hardware.name}...", flush=True)
    replica = replica_model(spec, Workload.sharegpt(1000, args.max_tokens), args.ttft_slo_ms, args.tpot_slo_ms)
    report = simulate_day(replica, args.peak_rps, args.offline_tokens_per_day, args.ttft_slo_ms, args.tpot_slo_ms)
    report["inputs"] = {"model": model.name, "hardware": hardware.name, "tensor_parallel_size": args.tp,
                        "peak_rps": args.peak_rps, "offline_tokens_per_day": args.offline_tokens_per_day,
                        "ttft_slo_ms": args.ttft_slo_ms, "tpot_slo_ms": args.tpot_slo_ms}
    report["replica"] = {k: v for k, v in replica.items()}
    e, s = report["elastic"], report["static_peak"]
    print(f"counted day {report['days']} of {report['days']} (the ones before bring the offline backlog to its cycle)")
    print(f"{'':>12} {'GPU-hours':>10} {'online in SLO':>14} {'offline arrived':>16} {'done':>10} "
          f"{'backlog start':>14} {'end':>10} {'max wait':>9}")
    for name, row in (("elastic", e), ("static_peak", s)):
        print(f"{name:>12} {row['gpu_hours']:>10} {row['online_minutes_within_slo_frac']:>14.2%} "
              f"{row['offline_arrived_tokens']:>16.4g} {row['offline_tokens']:>10.4g} "
              f"{row['offline_backlog_start_tokens']:>14.4g} {row['offline_backlog_end_tokens']:>10.4g} "
              f"{row['offline_max_wait_h']:>8.2f}h")
    if report["same_work"]:
        print(f"both fleets kept up with the offline work; elastic uses {report['gpu_hours_saved_frac']:.1%} fewer GPU-hours")
    else:
        behind = [name for name, row in (("elastic", e), ("static_peak", s)) if not row["kept_up"]]
        print(f"{' and '.join(behind)} fell behind (its backlog grew over the day): the fleets did not do the same "
              f"work, so their GPU-hours ({e['gpu_hours']} vs {s['gpu_hours']}) are not a saving")
    if args.plot:
        plot_day(report, args.plot)
    _write(args.json, report)
    return 0


def cmd_calibrate_cpu(args: argparse.Namespace) -> int:
    from autoscale.planning.calibrate import calibrate, calibrate_trace

    if args.from_trace:
        report = calibrate_trace(args.from_trace)
        for row in report["decode_steps"]:
            print(f"decode rows {row['decode_rows']:>6} ({row['steps']:>4} steps): measured {row['measured_ms']:>7.1f} ms, "
                  f"model {row['predicted_ms']:>7.1f} ms ({row['error']:+.0%})")
        print(f"fitted to {report['steps']} traced steps: {json.dumps(report['fitted'])}; "
              f"median error {report['median_abs_error']:.0%}")
        _write(args.json, report)
        return 0
    report = calibrate(args.batch_sizes, args.context_tokens, args.repeats)
    for row in report["points"]:
        print(f"batch {row['batch_size']:>3}: measured {row['measured_ms']:>7.1f} ms, model {row['predicted_ms']:>7.1f} ms "
              f"({row['error']:+.0%})")
    print(f"fitted: {json.dumps(report['fitted'])}; worst error {report['max_abs_error']:.0%}")
    _write(args.json, report)
    return 0


def cmd_scheduler_ab(args: argparse.Namespace) -> int:
    from app import paths
    from app.config import EngineConfig, load_pool_config
    from app.engine.sim.profiles import parse_sim_spec
    from app.engine.sim.runner import SimRunner
    from autoscale.planning.capacity import Workload
    from autoscale.planning.scheduler_ab import predict_workload, queued_order_gain, scheduler_ab

    if args.calibration:
        from autoscale.planning.calibrate import cpu_model, cpu_profile

        try:
            fitted = json.loads(Path(args.calibration).read_text())["fitted"]
            rates = fitted["memory_bandwidth_bytes_per_s"], fitted["flops"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{args.calibration}: not `plan calibrate-cpu --json` output (missing {exc})") from None
        runner = SimRunner(cpu_profile(*rates), cpu_model())
        kv_tokens, batch_tokens = args.kv_tokens or 8192, args.batch_tokens or 256  # the online pool's
        if args.step_trace:
            from app.engine.sim.measured import MeasuredRunner, read_step_trace

            runner = MeasuredRunner(runner, *read_step_trace(args.step_trace), source=", ".join(args.step_trace))
    else:
        hardware, model = parse_sim_spec(f"{args.hardware}:{args.model}")
        runner = SimRunner(hardware, model, args.tp)
        kv_tokens, batch_tokens = args.kv_tokens or runner.kv_budget_tokens(), args.batch_tokens or 2048
    config = EngineConfig(
        allocation="reserve_predicted", kv_cache_tokens=kv_tokens, max_num_batched_tokens=batch_tokens,
        max_num_seqs=256, default_max_tokens=args.max_tokens, max_model_len_tokens=args.max_tokens + 2048,
        ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms, aging_tokens_per_step=args.aging_tokens_per_step,
    )
    workload = Workload.sharegpt(2000, args.max_tokens)
    # NOTE: a real predictor's bounds at the online pool's quantile (serve_config.yaml), as the ingress reserves
    quantile = args.bound_quantile if args.bound_quantile is not None else load_pool_config("online").bound_quantile
    predictions = None if args.predictor == "oracle" else predict_workload(workload, args.predictor, quantile, paths.predictor_store())
    report = scheduler_ab(runner, config, workload, args.rates, args.duration, args.seeds, tuple(args.schedulers),
                          args.bucket_noise, predictions, args.order_by)
    a, b = report["schedulers"]
    r = report["runner"]
    print(f"{r['model']} tp={r['tp_size']} on {r['hardware']}, KV {kv_tokens} tokens, step budget {batch_tokens}, SLOs TTFT {args.ttft_slo_ms:g} ms / "
          f"TPOT {args.tpot_slo_ms:g} ms; medians of {args.seeds} seeds, {args.duration:g} s of arrivals")
    print(f"predictor {report['predictor']}, online orders by its {'ranking estimate' if args.order_by == 'rank' else 'reservation bound'}")
    print(f"{'rate':>6} {'scheduler':>10} {'mean E2E s':>10} {'TTFT p90 s':>10} {'TPOT p50 ms':>11} {'SLO met':>8} "
          f"{'goodput':>8} {'tok/s':>8} {'batch':>6}")
    for row in report["summary"]:
        for name in (a, b):
            m = row[name]
            print(f"{row['rate_rps']:>6g} {name:>10} {m['mean_e2e_s']:>10.1f} {m['p90_ttft_s']:>10.1f} {m['p50_tpot_ms']:>11.0f} "
                  f"{m['slo_attainment']:>8.1%} {m['goodput_rps']:>8.3f} {m['output_tokens_per_s']:>8.1f} "
                  f"{m['mean_running_batch']:>6.1f}")
        goodput = "n/a (no run of B met an SLO)" if row["goodput_ratio"] is None else f"{row['goodput_ratio']:.2f}x"
        print(f"{'':>6} {a} vs {b}: mean E2E {row['e2e_ratio']:.2f}x lower, goodput {goodput}")
    last = report["summary"][-1]
    slots = max(1, round(last[b]["mean_running_batch"]))
    requests = max(1, round(last["rate_rps"] * args.duration))
    report["queued_order_gain"] = {"requests": requests, "slots": slots,
                                   "gain": queued_order_gain(workload.output_tokens, requests, slots)}
    print(f"ceiling: {requests} answers all queued, {slots} at a time, exact shortest-first vs arrival order: mean "
          f"completion {report['queued_order_gain']['gain']:.2f}x lower")
    _write(args.json, report)
    if args.plot:
        from autoscale.planning.scheduler_ab import plot_ab

        plot_ab(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _common(p, slo: str = "online p99") -> None:
    p.add_argument("--model", default="llama-3-8b", help="model profile: llama-3-8b (default), llama-3-70b, smollm2-135m")
    p.add_argument("--hardware", default="H100-80G", help="GPU profile: A100-80G, H100-80G (default), H200")
    p.add_argument("--ttft-slo-ms", type=float, default=1000, help=f"{slo} TTFT objective (default 1000)")
    p.add_argument("--tpot-slo-ms", type=float, default=50, help=f"{slo} TPOT objective (default 50)")
    p.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of the requests (default 1024)")
    p.add_argument("--json", metavar="FILE")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="capacity planner: TP degree, replicas and cost per pool, from the engine's simulator",
        description="Simulates one replica per TP degree (1, 2, 4, 8) and KV policy (reserve_predicted, reserve_max, "
        "paged) with the real scheduler over the roofline cost model, and recommends each pool's TP degree and "
        "replicas for the traffic, with the cost per million tokens. `plan simulate-day` compares the elastic "
        "policy with static pools over a day; `plan calibrate-cpu` checks the cost model on this machine.",
    )
    _common(p)
    p.add_argument("--rate", type=float, default=10, help="online requests/s at peak (default 10)")
    p.add_argument("--offline-tokens-per-day", type=float, default=0, help="offline output tokens per day (default 0)")
    p.add_argument("--gpu-hour-usd", type=float, help="price of a GPU-hour (default: an assumed on-demand price)")
    p.add_argument("--plot", metavar="PNG", help="write the latency/throughput frontier for TP 1, 2, 4, 8")
    p.set_defaults(func=cmd_plan)
    plan_sub = p.add_subparsers(dest="plan_command")

    d = plan_sub.add_parser("simulate-day", help="elastic policy vs static pools over a simulated day",
                            description="Diurnal online load (cosine, trough 20%% of peak) plus a steady offline backlog; "
                            "the real ElasticPolicy decides both pools each minute. Three identical days run and the last "
                            "is counted. Reports, for both fleets, GPU-hours, the share of minutes within the online TTFT "
                            "SLO and the offline books (tokens arrived, done, backlog at the day's start and end, the "
                            "longest wait); the saving is claimed only when both fleets kept up with the offline work.")
    _common(d)
    d.add_argument("--tp", type=int, default=1, help="tensor-parallel size of a replica (default 1)")
    d.add_argument("--peak-rps", type=float, default=200, help="online requests/s at the daily peak (default 200)")
    d.add_argument("--offline-tokens-per-day", type=float, default=3e9, help="offline tokens arriving per day (default 3e9)")
    d.add_argument("--plot", metavar="PNG", help="write replicas and load over the day")
    d.set_defaults(func=cmd_simulate_day)

    c = plan_sub.add_parser("calibrate-cpu", help="fit the CPU profile's two constants to measured SmolLM2 step times",
                            description="Measures decode step times of the real model on this CPU over batch sizes, "
                            "fits the cost model's effective memory bandwidth and FLOP/s, and reports the model's error.")
    c.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64])
    c.add_argument("--context-tokens", type=int, default=256, help="cached tokens per sequence (default 256)")
    c.add_argument("--repeats", type=int, default=3, help="timed steps per batch size (median; default 3)")
    c.add_argument("--from-trace", nargs="+", metavar="JSONL",
                   help="fit to the steps a serving engine ran instead (files written under FORESERVE_STEP_TRACE)")
    c.add_argument("--json", metavar="FILE")
    c.set_defaults(func=cmd_calibrate_cpu)

    ab = plan_sub.add_parser(
        "scheduler-ab", help="the online scheduler vs FCFS under open-loop load, on the simulator",
        description="Poisson arrivals of ShareGPT validation lengths into one simulated replica, the same "
        "arrivals for both schedulers, every request served to completion; medians over seeds of mean E2E, "
        "p90 TTFT, TPOT, SLO attainment, goodput and tokens/s, and the ratios. Modelled time: a rate sweep "
        "takes seconds and has no machine noise. --calibration takes `plan calibrate-cpu --json` output and "
        "simulates this machine's SmolLM2 (fit it --from-trace to time the steps as the service runs them).")
    _common(ab, slo="each request's")  # NOTE: scored per request, as the load test scores, not at p99
    ab.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the replica (default 1)")
    ab.add_argument("--calibration", metavar="JSON", help="a CPU profile from `plan calibrate-cpu --json` (then the "
                    "model is SmolLM2-135M float32, --hardware/--model are ignored)")
    ab.add_argument("--step-trace", nargs="+", metavar="JSONL",
                    help="with --calibration: time each step as the traced engine timed steps of its size (median "
                    "per size, decode-only and with a prefill chunk apart; files written under FORESERVE_STEP_TRACE) "
                    "instead of the fitted roofline")
    ab.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], required=True,
                    help="requests/s, comma-separated, e.g. 0.3,0.6 with --calibration or 20,40 on an H100")
    ab.add_argument("--duration", type=float, default=90, help="seconds of arrivals per run (default 90)")
    ab.add_argument("--seeds", type=int, default=3, help="runs per rate and scheduler; medians reported (default 3)")
    ab.add_argument("--kv-tokens", type=int, help="KV pool (default: the online pool's 8192 with --calibration, "
                    "else what the GPU holds next to the weights)")
    ab.add_argument("--batch-tokens", type=int, help="per-step token budget (default 256 with --calibration, else 2048)")
    ab.add_argument("--bucket-noise", type=float, default=0.0,
                    help="std-dev in buckets added to the oracle's prediction (default 0: exact buckets)")
    ab.add_argument("--predictor", default="oracle",
                    help="oracle (default: exact buckets, blurred by --bucket-noise, and exact lengths to order by) "
                    "or a real predictor (champion, a registry version, a model directory) run over the trace's prompts")
    ab.add_argument("--bound-quantile", type=float, help="a real predictor's reservation quantile (default: the "
                    "online pool's bound_quantile in serve_config.yaml, 0.8)")
    ab.add_argument("--order-by", choices=("rank", "bound"), default="rank",
                    help="what the online scheduler orders by: the predictor's ranking estimate (default) or its "
                    "reservation bound")
    ab.add_argument("--aging-tokens-per-step", type=float, default=0.25,
                    help="the online scheduler's aging: predicted tokens forgiven per step waited (default 0.25)")
    ab.add_argument("--schedulers", type=lambda s: s.split(","), default=["online", "fcfs"],
                    help="the two schedulers (default online,fcfs), each with engine settings after colons if "
                    "wanted: online:tpot_target_ms=150,online:tpot_slowdown=null:knee_throughput_fraction=1")
    ab.add_argument("--plot", metavar="PNG", help="write TPOT p50, goodput and mean E2E against the rate")
    ab.set_defaults(func=cmd_scheduler_ab)
