"""Bound-quantile sweep in modelled time: the throughput benchmark's replay at several request counts
and quantiles, through the real scheduler and allocation code, with a step-time model instead of
the model (seconds for hundreds of requests, and no machine noise).

    python -m scripts.quantile_sweep --requests 32 64 128 --predictor champion --quantiles 0.9,0.8,0.7

The offline schedule does not depend on timing, so the mean batch, steps and preemptions are what
the real benchmark gets; tok/s are modelled: ``step_s = base + per_context_token * (tokens the step
attends to) + per_prefill_token * (prompt tokens it computes)``. The defaults are fitted to
``runner_microbench`` on this repository's 2-core CPU (SmolLM2-135M float32, paged decode kernel).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from app.config import EngineConfig
from app.engine.outputs import ModelRunnerOutput, SchedulerOutput
from app.engine.runner import Runner
from loadtests.bench.throughput import DEFAULT_SCHEDULER, load_requests, make_predictor, run_policy
from predictor.buckets import LengthBuckets


@dataclass
class StepModel:
    base_s: float = 0.044
    per_context_token_s: float = 4.5e-6
    per_prefill_token_s: float = 0.4e-3


class ModelledRunner(Runner):
    """Samples a fixed token and reports the step model's time (the engine clock follows it)."""

    simulated = True
    eos_token_id = 2

    def __init__(self, model: StepModel) -> None:
        self.model = model

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        context = sum(c.start_pos + len(c.token_ids) for c in out.chunks)
        prefill = sum(len(c.token_ids) for c in out.chunks if len(c.token_ids) > 1)
        m = self.model
        step_s = m.base_s + m.per_context_token_s * context + m.per_prefill_token_s * prefill
        return ModelRunnerOutput(sampled_token_ids={c.request_id: 100 for c in out.chunks if c.sample}, step_s=step_s)


def sweep(requests: list[int], predictor: str, quantiles: list[float], kv_tokens: int = 4096,
          max_tokens: int = 1024, model: StepModel | None = None) -> list[dict]:
    """One row per (request count, predictor row): reserve_max, the predictor at each quantile,
    then the oracle predictor; ``x_reserve_max`` is modelled tok/s over reserve_max's."""
    model = model or StepModel()
    buckets = LengthBuckets(max_tokens=max_tokens)
    rows = []
    for n in requests:
        reqs = load_requests(n, max_tokens)
        specs = [("reserve_max", "max", None)] + [(f"{predictor}:{q}", predictor, q) for q in quantiles]
        specs.append(("oracle", "oracle", None))
        base = None
        for label, name, q in specs:
            policy = "reserve_max" if label == "reserve_max" else "reserve_predicted"
            config = EngineConfig(kv_cache_tokens=kv_tokens, default_max_tokens=max_tokens, max_model_len_tokens=max_tokens + 1024,
                                  allocation=policy, scheduler=DEFAULT_SCHEDULER[policy])
            row = run_policy(config, ModelledRunner(model), config.kv_pool_blocks(1), reqs,
                             make_predictor(name, reqs, buckets, q), name=label)
            base = base or row["output_tokens_per_s"]
            rows.append({"requests": n, "predictor": label, "mean_batch": row["mean_running_batch"], "steps": row["steps"],
                         "preemptions": row["preemptions"], "recomputed_tokens": row["recomputed_tokens"],
                         "modelled_tokens_per_s": row["output_tokens_per_s"],
                         "x_reserve_max": round(row["output_tokens_per_s"] / base, 3)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 64, 128, 256, 512], help="request counts replayed")
    ap.add_argument("--predictor", default="champion", help="champion, a registry version or a model directory")
    ap.add_argument("--quantiles", default="0.9,0.8,0.7,0.6,0.5", help="bound quantiles, comma-separated")
    ap.add_argument("--kv-tokens", type=int, default=4096, help="KV pool in tokens (the benchmark's 4,096)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of every request")
    ap.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = ap.parse_args(argv)
    from app.runtime_env import process_defaults

    process_defaults()  # NOTE: a command of its own: offline hub, no MLflow telemetry
    if ":" in args.predictor:
        ap.error("--predictor takes a predictor without :Q; the quantiles come from --quantiles")
    quantiles = [float(q) for q in args.quantiles.split(",") if q.strip()]
    if not quantiles or not all(0 < q <= 1 for q in quantiles):
        ap.error(f"--quantiles takes quantiles in (0, 1], got {args.quantiles!r}")
    rows = sweep(args.requests, args.predictor, quantiles, args.kv_tokens, args.max_tokens)
    print(f"{'requests':>8} {'predictor':>16} {'batch':>6} {'steps':>7} {'preempt':>7} {'x reserve_max':>13}")
    for r in rows:
        print(f"{r['requests']:>8} {r['predictor']:>16} {r['mean_batch']:>6.2f} {r['steps']:>7} {r['preemptions']:>7} "
              f"{r['x_reserve_max']:>13.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_model": vars(StepModel()), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
