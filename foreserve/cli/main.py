"""The `foreserve` command: assembles the command groups and turns bad input into one line."""

from __future__ import annotations

import argparse
import sys

from foreserve.cli import batch, bench, chaos, loadtest, plan, predictor, prepare, serve
from app.runtime_env import process_defaults

GROUPS = (prepare, serve, bench, predictor, batch, plan, loadtest, chaos)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foreserve",
        description="LLM serving that predicts each request's output length and uses it to reserve KV memory and schedule.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    process_defaults()
    args = build_parser().parse_args(argv)
    for name in ("requests", "kv_tokens", "max_tokens", "tp", "repeats", "replicas", "batch_size", "rows", "users",
                 "max_num_batched_tokens", "prompts"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except Exception as exc:
        # NOTE: bad input (a spec, a config, a missing package or file) and a store MLflow cannot
        # reach or write (locked, unreachable) read as one line, not a traceback; pydantic's
        # ValidationError is a ValueError and lists every bad field. MLflow is never imported here.
        mlflow_error = getattr(sys.modules.get("mlflow.exceptions"), "MlflowException", ())
        if not isinstance(exc, (ValueError, OSError, RuntimeError, mlflow_error)):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
