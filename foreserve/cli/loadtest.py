"""``foreserve loadtest``: Locust SLO load tests (one run, ``ab`` of two schedulers, ``peer`` against
llama-server, ``stub-check``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _comma_separated(cast, what: str):
    """An argparse type: a comma-separated list of ``cast`` values, named ``what`` when one is not."""
    def parse(text: str) -> list:
        try:
            return [cast(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated {what}; got {text!r}") from None
    return parse


def _spec(args: argparse.Namespace, stages: str | None = None):
    from loadtests.loadtest import LoadSpec
    from loadtests.shapes import parse_shape
    from loadtests.stages import parse_stages, parse_tier_mix
    from loadtests.summary import SLO

    stages = stages or args.stages or f"steady:{args.duration:g}:{args.users if args.mode == 'closed' else args.rate:g}"
    parse_stages(stages)  # a clear error before anything starts
    slos = {"online": SLO(ttft_ms=args.ttft_slo_ms, tpot_ms=args.tpot_slo_ms),
            "flex": SLO(ttft_ms=args.flex_ttft_slo_ms or 10 * args.ttft_slo_ms,
                        tpot_ms=args.flex_tpot_slo_ms or 10 * args.tpot_slo_ms)}
    shapes = [str(parse_shape(s)) for s in args.shape or []]  # a clear error before anything starts
    if shapes and args.natural_eos:
        raise ValueError("--shape asks for exactly OUTPUT_TOKENS tokens (ignore_eos); drop --natural-eos")
    return LoadSpec(stages=stages, mode=args.mode, tier_mix=parse_tier_mix(args.tier_mix), max_tokens=args.max_tokens,
                    slos=slos, seed=args.seed, drain_s=args.drain_s, think_s=args.think_s,
                    ignore_eos=not args.natural_eos, shapes=shapes, arrivals=args.arrivals, tokenizer=args.tokenizer)


def print_summary(summary: dict) -> None:
    config = summary.get("config", {})
    workload = f"shapes {','.join(config['shapes'])}" if config.get("shapes") else "ShareGPT prompts"
    print(f"{summary['duration_s']:.0f} s at {summary['rate']} req/s offered ({config.get('arrivals', 'poisson')} "
          f"arrivals, {workload}); SLOs {json.dumps(summary['slo'])}")
    print(f"{'tier':>6} {'reqs':>5} {'fail':>4} {'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90 ms':>16} {'E2E mean ms':>11} "
          f"{'SLO ok':>7} {'goodput':>8} {'tok/s':>6}")
    for tier, s in summary["tiers"].items():
        if not s["requests"]:
            continue
        ttft = "/".join("-" if s["ttft_ms"][q] is None else f"{s['ttft_ms'][q]:.0f}" for q in ("p50", "p90", "p99"))
        tpot = "/".join("-" if s["tpot_ms"][q] is None else f"{s['tpot_ms'][q]:.0f}" for q in ("p50", "p90"))
        mean = "-" if s["e2e_ms"]["mean"] is None else f"{s['e2e_ms']['mean']:.0f}"
        print(f"{tier:>6} {s['requests']:>5} {s['failures']:>4} {ttft:>22} {tpot:>16} {mean:>11} "
              f"{s['slo_attainment']:>7.1%} {s['goodput_rps']:>8.3f} {s['output_tokens_per_s']:>6.1f}")


def cmd_loadtest(args: argparse.Namespace) -> int:
    from loadtests.loadtest import run_load

    spec = _spec(args)
    if args.host and (args.scheduler or args.config or args.dtype):
        raise ValueError("--scheduler, --dtype and --config set up the service loadtest starts; with --host the service is yours")
    config = Path(args.config) if args.config else None
    if not args.host:
        config = _scheduler_config(args, config)
    summary = run_load(spec, Path(args.report), args.host, config)
    print_summary(summary)
    print(f"wrote {args.report}/summary.json, report.html (plots), locust.html and Locust's CSVs")
    return 0


def _scheduler_config(args: argparse.Namespace, config: Path | None) -> Path | None:
    scheduler, dtype = getattr(args, "scheduler", None), getattr(args, "dtype", None)
    if not scheduler and not dtype:
        return config
    from app.config import DEFAULT_CONFIG_PATH
    from loadtests.ab import scheduler_config

    return scheduler_config(config or DEFAULT_CONFIG_PATH, Path(args.report) / "serve_config.yaml", scheduler,
                            _spec(args).slos["online"] if scheduler else None, dtype=dtype)


def cmd_ab(args: argparse.Namespace) -> int:
    from app.config import DEFAULT_CONFIG_PATH
    from loadtests.ab import run_ab

    if args.mode != "open":
        raise ValueError("loadtest ab runs open-loop arrivals (a rate sweep); drop --mode closed")
    result = run_ab(_spec(args), args.rates, args.duration, Path(args.report), Path(args.config or DEFAULT_CONFIG_PATH),
                    tuple(args.schedulers), args.repeats)
    a, b = result["schedulers"]
    print(f"\n{'rate':>5} | {a + ' E2E ms':>13} {b + ' E2E ms':>13} {'ratio':>6} | {a + ' goodput':>14} "
          f"{b + ' goodput':>14} {'ratio':>6} | {'tok/s':>11} | {'preemptions':>11}")
    for row in result["by_rate"]:
        print(f"{row['rate']:>5g} | {row[a]['mean_e2e_ms'] or 0:>13.0f} {row[b]['mean_e2e_ms'] or 0:>13.0f} "
              f"{row['mean_e2e_ratio'] or 0:>6.2f} | {row[a]['goodput_rps']:>14.3f} {row[b]['goodput_rps']:>14.3f} "
              f"{row['goodput_ratio'] or 0:>6.2f} | {row[a]['output_tokens_per_s']:>5.0f} {row[b]['output_tokens_per_s']:>5.0f} "
              f"| {row[a]['preemptions']:>5.0f} {row[b]['preemptions']:>5.0f}")
    print(f"wrote {args.report}/ab.json, ab.png and a report per scheduler and rate")
    return 0


def cmd_peer(args: argparse.Namespace) -> int:
    import os

    from app.config import DEFAULT_CONFIG_PATH
    from loadtests.peer import run_peer, step_policy

    if args.mode != "open":
        raise ValueError("loadtest peer runs open-loop arrivals (a rate sweep); drop --mode closed")
    for t in args.tpot_targets:
        step_policy(t)  # ValueError for a spec it does not know
    if args.slots < 1 or args.ctx_tokens < 1:
        raise ValueError("--slots and --ctx-tokens must be >= 1")
    if any(r <= 0 for r in args.rates) or len(set(args.rates)) < len(args.rates):
        raise ValueError(f"--rates must be distinct rates above 0, got {','.join(f'{r:g}' for r in args.rates)}")
    if len(set(args.tpot_targets)) < len(args.tpot_targets):
        raise ValueError(f"--tpot-targets names a variant twice: {','.join(args.tpot_targets)}")
    threads = args.online_threads or [None]
    if args.online_threads and (min(threads) < 1 or len(set(threads)) < len(threads)):
        raise ValueError(f"--online-threads must be distinct counts >= 1, got {','.join(map(str, threads))}")
    variants = [(t, n) for t in args.tpot_targets for n in threads]
    spec = _spec(args)
    if spec.tier_mix.get("online", 0) <= 0:
        raise ValueError("loadtest peer compares the online tier: give --tier-mix an online share")
    llama = {"dtype": args.llama_cpp, "slots": args.slots, "ctx_tokens": args.ctx_tokens,
             "threads": args.threads or os.cpu_count() or 1}
    result = run_peer(spec, args.rates, args.duration, Path(args.report), Path(args.config or DEFAULT_CONFIG_PATH),
                      variants, llama, args.repeats)
    keys = ("ttft_p90_ms", "tpot_p50_ms", "mean_e2e_ms", "slo_attainment", "good_per_window_rps", "output_tokens_per_s",
            "failures")
    print(f"\nmedians of {args.repeats}; TTFT p90, TPOT p50 and mean E2E of the answered requests; goodput "
          "(good_per_window_rps) per second of arrivals")
    print(f"{'rate':>5} {'system':<28}" + "".join(f"{k:>20}" for k in keys))
    for row in result["by_rate"]:
        for system, med in row["medians"].items():
            print(f"{row['rate']:>5g} {system:<28}" + "".join(f"{'-' if med[k] is None else f'{med[k]:g}':>20}" for k in keys))
        for system, checks in row["targets"].items():
            print(f"      {system} against llama-server: " + ", ".join(
                f"{c['metric']} {c['ratio']}x ({'met' if c['met'] else 'NOT met'})" for c in checks))
    print(f"wrote {args.report}/peer.json, peer.png and a report per system, rate and repeat")
    return 0


def cmd_stub_check(args: argparse.Namespace) -> int:
    from loadtests.ab import run_stub_check

    spec = _spec(args, f"steady:{args.duration:g}:{args.rate * args.factor:g}")
    check = run_stub_check(spec, Path(args.report), args.stub_ttft_ms, args.stub_itl_ms)
    print(json.dumps(check, indent=2))
    # NOTE: Poisson counts vary (±2 sqrt(n)); lag is what shows a generator falling behind
    ok = not check["failures"] and check["p99_send_lag_ms"] < 100 and check["sent_rps"] >= 0.8 * check["target_rps"]
    print(f"the generator {'kept' if ok else 'did NOT keep'} up with {check['target_rps']:g} req/s "
          f"({args.factor:g}x the tested {args.rate:g})")
    return 0 if ok else 1


def _load_options(p, rate_default: float = 0.5) -> None:
    p.add_argument("--rate", type=float, default=rate_default, help=f"requests/s (default {rate_default})")
    p.add_argument("--arrivals", choices=("poisson", "constant"), default="poisson",
                   help="open loop: Poisson arrivals at the rate (default), or one every 1/rate s (guidellm's constant)")
    p.add_argument("--shape", action="append", metavar="PROMPT_TOKENS:OUTPUT_TOKENS",
                   help="fixed-shape requests instead of ShareGPT's: prompts of exactly PROMPT_TOKENS tokens asking "
                   "for exactly OUTPUT_TOKENS (ignore_eos); repeat it to mix shapes uniformly, e.g. --shape 256:128 "
                   "--shape 1024:32")
    p.add_argument("--tokenizer", help="HF folder whose tokenizer counts --shape's prompt tokens (default: the "
                   "embedded model's)")
    p.add_argument("--duration", type=float, default=60, help="seconds of arrivals (default 60)")
    p.add_argument("--ttft-slo-ms", type=float, default=2000, help="online TTFT objective (default 2000, as serve_config.yaml)")
    p.add_argument("--tpot-slo-ms", type=float, default=250, help="online TPOT objective (default 250, as serve_config.yaml)")
    p.add_argument("--flex-ttft-slo-ms", type=float, help="flex TTFT objective (default 10x the online one)")
    p.add_argument("--flex-tpot-slo-ms", type=float, help="flex TPOT objective (default 10x the online one)")
    p.add_argument("--tier-mix", default="online=1", help="e.g. online=0.7,flex=0.3 (default online=1)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="each request's max_tokens = its true ShareGPT length capped at this (default 256)")
    p.add_argument("--natural-eos", action="store_true", help="let answers end at EOS (default: ignore_eos, exact lengths)")
    p.add_argument("--mode", choices=("open", "closed"), default="open",
                   help="open: Poisson arrivals at --rate (default); closed: --users users back to back")
    p.add_argument("--users", type=int, default=4, help="closed loop: concurrent users (default 4)")
    p.add_argument("--think-s", type=float, default=0, help="closed loop: pause between a user's requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order, tiers and arrival times")
    p.add_argument("--drain-s", type=float, default=120, help="wait this long for requests in flight after the arrivals")
    p.add_argument("--config", help="serve_config.yaml for the service it starts (default: the repository's)")


def _sweep_options(p, rates: list[float], report: str, repeats_help: str) -> None:
    """--rates, --repeats and --report of a sweep (``ab``, ``peer``)."""
    p.add_argument("--rates", type=_comma_separated(float, "request rates, e.g. 1,1.5"), default=rates,
                   help=f"comma-separated request rates, a sweep (default {','.join(f'{r:g}' for r in rates)})")
    p.add_argument("--repeats", type=int, default=1, help=f"{repeats_help}; medians (default 1)")
    p.add_argument("--report", default=report, help=f"report directory (default {report})")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "loadtest", help="Locust SLO load test: TTFT/TPOT/ITL/E2E, SLO attainment and goodput per tier, HTML report",
        description="Runs Locust headless (its own process) against --host, or against a service it starts from "
        "serve_config.yaml on a free port and stops after. Prompts are ShareGPT validation prompts; each request "
        "streams, with max_tokens = the prompt's true length capped at --max-tokens. Writes REPORT/summary.json, "
        "report.html (latency CDFs, latency over time with the SLO, replicas over time), locust.html and Locust's "
        "CSVs. `loadtest ab` compares the online pool's schedulers; `loadtest peer` runs the same load against "
        "llama.cpp's llama-server; `loadtest stub-check` tests the generator.",
    )
    _load_options(p)
    p.add_argument("--stages", help="instead of --rate/--duration: name:seconds:level[,...], level = rps (open) or users "
                   "(closed), start-end ramps, e.g. ramp:30:0.1-0.5,steady:60:0.5,burst:10:2")
    p.add_argument("--host", help="URL of a running service (default: start one); its API key, if any, from "
                   "$FORESERVE_API_KEY")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                   help="weights dtype of every pool of the service it starts (default: the config's)")
    p.add_argument("--scheduler", choices=("online", "fcfs"),
                   help="online pool's scheduler for the service it starts (its SLOs then become the test's)")
    p.add_argument("--report", default="reports/loadtest", help="report directory (default reports/loadtest)")
    p.set_defaults(func=cmd_loadtest, stages=None)
    lsub = p.add_subparsers(dest="loadtest_command")

    a = lsub.add_parser("ab", help="the same load against the online scheduler `online` and `fcfs`, back to back",
                        description="For each scheduler a fresh service (only pools.online.scheduler differs; the online "
                        "pool is given the test's SLOs; autoscaling off, each pool at its initial replicas) gets the "
                        "same prompts at the same Poisson arrival times, at each rate of --rates; prints mean E2E "
                        "and goodput ratios per rate, writes ab.json, ab.png and every run's report.")
    _load_options(a)
    _sweep_options(a, [0.3, 0.5], "reports/loadtest_ab", "repeat the pair (order alternates)")
    a.add_argument("--schedulers", type=lambda s: s.split(","), default=["online", "fcfs"],
                   help="the two schedulers (default online,fcfs)")
    a.set_defaults(func=cmd_ab, stages=None)

    q = lsub.add_parser("peer", help="the same online load against foreserve and llama.cpp's llama-server, back to back",
                        description="At each rate of --rates, the same prompts at the same Poisson arrival times "
                        "against llama-server (`make llama-cpp` builds it; a fresh server per run, the served weights "
                        "as a GGUF) and against a service started from --config, once per --tpot-targets (and --online-threads) variant; "
                        "medians of --repeats (the order alternates). Prints each system's figures and the online "
                        "targets against llama-server (TPOT p50, mean E2E, TTFT p90 no higher; goodput 1.5x), "
                        "writes peer.json, peer.png and every run's report.")
    _load_options(q)
    _sweep_options(q, [1.0, 1.5], "reports/loadtest_peer", "repeat every system (order alternates)")
    q.add_argument("--tpot-targets", type=lambda s: s.split(","), default=["default"],
                   help="foreserve variants, the online pool's step policy: `default` (the config's), `knee` (the "
                   "throughput knee), `knee:F` (the knee at F of the best throughput, knee_throughput_fraction), "
                   "`slowdown:K` (steps within K one-token steps, tpot_slowdown) or a step time in ms "
                   "(tpot_target_ms), e.g. default,knee,slowdown:3,60 (default: default)")
    q.add_argument("--online-threads", type=_comma_separated(int, "thread counts, e.g. 1,2"),
                   help="foreserve variants: the online pool's torch_threads, e.g. 1,2; each --tpot-targets variant "
                   "runs at each count (default: the config's)")
    q.add_argument("--llama-cpp", choices=("bf16", "f32", "q4_1"), default="bf16", help="llama-server's GGUF dtype (default bf16)")
    q.add_argument("--slots", type=int, default=8, help="llama-server's parallel slots, -np (default 8)")
    q.add_argument("--ctx-tokens", type=int, default=8192, help="llama-server's unified KV cache, -c (default 8192)")
    q.add_argument("--threads", type=int, help="llama-server's threads, -t and -tb (default: every core)")
    q.set_defaults(func=cmd_peer, stages=None)

    s = lsub.add_parser("stub-check", help="the load generator alone, at a multiple of a rate, against a stub endpoint",
                        description="Starts loadtests/stub_server.py (streams max_tokens chunks, no model) and runs the "
                        "open-loop load at --factor times --rate; reports the rate actually sent, send lag and failures.")
    _load_options(s, rate_default=0.5)
    s.add_argument("--factor", type=float, default=5, help="multiple of --rate to send (default 5)")
    s.add_argument("--stub-ttft-ms", type=float, default=50)
    s.add_argument("--stub-itl-ms", type=float, default=20)
    s.add_argument("--report", default="reports/loadtest_stub", help="report directory (default reports/loadtest_stub)")
    s.set_defaults(func=cmd_stub_check, stages=None)
