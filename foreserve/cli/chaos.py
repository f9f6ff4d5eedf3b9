"""``foreserve chaos``: fault scenarios under load against a live service (loadtests/chaos/run.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT = ("engine_kill,forward_error,engine_freeze,predictor_kill,predictor_freeze,controller_kill,registry_outage,redeploy,"
           "overload,scale_down,batch,"
           "disconnect_storm,fuzz,hostile_input,tenants,drain")


def cmd_chaos(args: argparse.Namespace) -> int:
    from loadtests.chaos.run import run_chaos

    summary = run_chaos(Path(args.report), args.scenarios.split(","), args.host, Path(args.config) if args.config else None,
                        args.rate, args.duration, args.inject_at, args.storm_streams, args.overload_rate,
                        args.fuzz_examples, args.soak_minutes, flex_share=args.flex_share,
                        overload_shapes=tuple(args.overload_shape or ()))
    print(f"{'scenario':>17} {'sent':>5} {'answered':>8} {'clean err':>9} {'hung':>4} {'broken':>6} {'recovery s':>10} {'health ok s':>11}")
    for r in summary["scenarios"]:
        print(f"{r['scenario']:>17} {r['sent']:>5} {r['answered']:>8} {r['clean_error']:>9} {r['hung']:>4} {r['broken']:>6} "
              f"{str(r.get('recovery_s')):>10} {str(r.get('health_ok_after_s')):>11}")
    print(f"wrote {args.report}/summary.json and report.html")
    return 1 if summary["hung"] or summary["broken"] else 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "chaos", help="inject faults into a live service under load; report what was lost",
        description="Starts the service (two API keys) or takes --host, runs each scenario in turn and writes "
        "summary.json and report.html: requests sent, answered in full, clean OpenAI errors, hung, broken, "
        "recovery time and memory per scenario. Signal faults need the service on this machine. "
        "Exit status 1 if any request hung or broke.")
    p.add_argument("--scenarios", default=DEFAULT, help=f"comma-separated, in order (default {DEFAULT})")
    p.add_argument("--host", help="a running service (default: start one); its keys in FORESERVE_API_KEY and "
                   "FORESERVE_API_KEY_B for the tenants scenario")
    p.add_argument("--config", help="serve config for the service it starts (default serve_config.yaml)")
    p.add_argument("--rate", type=float, default=0.5, help="load scenarios: requests/s (default 0.5)")
    p.add_argument("--duration", type=float, default=60, help="load scenarios: seconds of arrivals (default 60)")
    p.add_argument("--inject-at", type=float, default=15, help="load scenarios: the fault this many seconds in (default 15)")
    p.add_argument("--flex-share", type=float, default=0.2,  # loadtests.chaos.load.FLEX_SHARE (imported late)
                   help="load scenarios: the share of requests sent as service_tier flex (default 0.2)")
    p.add_argument("--overload-shape", action="append", metavar="PROMPT_TOKENS:OUTPUT_TOKENS",
                   help="overload: fixed-shape requests instead of ShareGPT's (repeat to mix), e.g. 1024:16: "
                   "long prompts overload a pool at a rate that short chats do not")
    p.add_argument("--overload-rate", type=float, default=6.0,
                   help="overload: requests/s (default 6, about 3x what the default service answers on 2 cores)")
    p.add_argument("--fuzz-examples", type=int, default=20, help="fuzz: generated requests per route (default 20)")
    p.add_argument("--soak-minutes", type=float, default=30, help="soak: minutes of steady load (default 30; not in the default scenarios)")
    p.add_argument("--storm-streams", type=int, default=200, help="disconnect storm: streams cut at once (default 200)")
    p.add_argument("--report", default="reports/chaos", help="output folder (default reports/chaos)")
    p.set_defaults(func=cmd_chaos)
