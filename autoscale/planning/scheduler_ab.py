"""Scheduler A/B on the simulator: the same open-loop load against ``online`` and ``fcfs`` in
modelled time, so a rate sweep takes seconds and has no machine noise.

Each run sends Poisson arrivals at a rate for ``duration_s`` into one replica (the real scheduler and
KV policy over SimRunner's roofline step time), serves every request to completion and scores it as
``foreserve loadtest`` does: TTFT, TPOT = (E2E - TTFT) / (tokens - 1), E2E, and goodput = requests
per second of arrivals that met both SLOs (DistServe's definition). Both schedulers see the same
arrival times and requests for a seed.

What the engine is told of each answer: by default the oracle's bucket (its upper edge is the
reservation; ``bucket_noise`` blurs it to a classifier's accuracy) and the exact length to order by.
``Predictions`` from a real predictor over the trace's prompts (``predict_workload``) give its
buckets, bounds and ranking estimates instead; ``order_by="bound"`` hides the ranking estimate, so
the online scheduler orders by the reservation bound, as it does for a predictor without one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from app.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.clock import ModelledClock
from app.engine.request import EngineRequest, Prediction, SamplingParams
from app.engine.sim.replay import ReplayRunner
from app.engine.sim.runner import SimRunner
from autoscale.planning.capacity import Workload
from predictor.buckets import LengthBuckets
from predictor.store import Store


@dataclass(frozen=True)
class Predictions:
    """Per workload request: predicted bucket, reservation bound and ranking estimate (tokens)."""

    buckets: list[int]
    bounds: list[int]
    rank_tokens: list[float] | None
    source: str


def predict_workload(workload: Workload, predictor_name: str, bound_quantile: float | None = None,
                     store: Store | None = None) -> Predictions:
    """A real predictor (``champion``, a version, a model directory) over the workload's prompts,
    its bounds at ``bound_quantile`` (None: the version's own). ``store``: the registry an alias or
    a version is looked up in (a model directory needs none)."""
    from predictor.loading import load_predictor

    if not workload.texts:
        raise ValueError("this workload has no prompt texts (build the traces with `foreserve prepare`)")
    predictor = load_predictor(predictor_name, LengthBuckets(max_tokens=workload.max_tokens), bound_quantile=bound_quantile,
                               store=store)
    pred = predictor.predict(workload.texts)
    return Predictions(list(pred.buckets), list(pred.bound_tokens), pred.rank_tokens,
                       f"{predictor_name} (version {getattr(predictor, 'version', '?')})")


@dataclass(frozen=True)
class LoadRun:
    scheduler: str
    rate_rps: float
    seed: int
    requests: int
    mean_e2e_s: float
    p90_ttft_s: float
    p50_tpot_ms: float
    slo_attainment: float
    goodput_rps: float
    output_tokens_per_s: float
    mean_running_batch: float


def simulate_load(runner: SimRunner, config: EngineConfig, workload: Workload, rate_rps: float,
                  duration_s: float, seed: int = 0, bucket_noise: float = 0.0,
                  predictions: Predictions | None = None, order_by: str = "rank", label: str | None = None) -> LoadRun:
    """One open-loop run of ``config.scheduler`` (the runner is stateless between runs); ``label``
    names it in the result (default: the scheduler's name)."""
    if order_by not in ("rank", "bound"):
        raise ValueError(f"order_by is 'rank' or 'bound', got {order_by!r}")
    replay = ReplayRunner(runner)
    engine = LLMEngine(config, replay, config.kv_pool_blocks(runner.kv_bytes_per_token), clock=ModelledClock())
    buckets = LengthBuckets(max_tokens=workload.max_tokens, num_buckets=config.num_buckets)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, int(rate_rps * duration_s * 2) + 10))
    arrivals = arrivals[arrivals < duration_s]
    picks = rng.integers(0, len(workload.prompt_tokens), len(arrivals))
    noise = rng.normal(0.0, bucket_noise, len(arrivals)) if bucket_noise else np.zeros(len(arrivals))
    arrived: dict[str, float] = {}
    lengths: dict[str, int] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    i = 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            engine.clock.idle_until(float(arrivals[i]))
        while i < len(arrivals) and arrivals[i] <= engine.clock():
            k, out = picks[i], workload.output_tokens[picks[i]]
            if predictions is None:
                bucket = int(np.clip(round(buckets.bucket_of(out) + noise[i]), 0, buckets.num_buckets - 1))
                bound, rank = buckets.upper_bound_tokens(bucket), float(out)
            else:
                bucket, bound = predictions.buckets[k], predictions.bounds[k]
                rank = predictions.rank_tokens[k] if predictions.rank_tokens else None
            rid = str(i)
            replay.lengths[rid] = out  # ends at its recorded length
            engine.add_request(EngineRequest(
                prompt_token_ids=[1] * workload.prompt_tokens[k],
                sampling=SamplingParams(max_tokens=workload.max_tokens),
                request_id=rid, detokenize=False,
                prediction=Prediction(bucket=bucket, bound_tokens=bound, rank_tokens=rank if order_by == "rank" else None,
                                      exact_tokens=out),
            ))
            arrived[rid], lengths[rid] = float(arrivals[i]), out
            i += 1
        for o in engine.step():
            first.setdefault(o.request_id, engine.clock())
            if o.finished:
                done[o.request_id] = engine.clock()
    ttft = np.array([first[r] - arrived[r] for r in done])
    e2e = np.array([done[r] - arrived[r] for r in done])
    tpot = np.array([(done[r] - first[r]) / max(lengths[r] - 1, 1) for r in done])
    met = (ttft <= config.ttft_slo_ms / 1000) & (tpot <= config.tpot_slo_ms / 1000)
    stats = engine.stats()
    return LoadRun(
        scheduler=label or config.scheduler, rate_rps=rate_rps, seed=seed, requests=len(done),
        mean_e2e_s=round(float(e2e.mean()), 3), p90_ttft_s=round(float(np.percentile(ttft, 90)), 3),
        p50_tpot_ms=round(float(np.median(tpot)) * 1000, 1), slo_attainment=round(float(met.mean()), 4),
        goodput_rps=round(float(met.sum()) / duration_s, 4),
        output_tokens_per_s=round(stats.output_tokens / engine.clock(), 2),
        mean_running_batch=round(stats.mean_running_batch, 2),
    )


def scheduler_config(config: EngineConfig, spec: str) -> EngineConfig:
    """``online``, ``fcfs``, ... with engine settings after colons: ``online:tpot_target_ms=150``,
    ``online:tpot_slowdown=null:knee_throughput_fraction=1`` (values are parsed as YAML scalars)."""
    import yaml

    name, *settings = spec.split(":")
    update: dict = {"scheduler": name}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or key not in EngineConfig.model_fields:
            raise ValueError(f"{spec!r}: settings after the scheduler are field=value of the engine config, got {setting!r}")
        update[key] = yaml.safe_load(value)
    return EngineConfig.model_validate(config.model_dump() | update)


def scheduler_ab(runner: SimRunner, config: EngineConfig, workload: Workload, rates: list[float],
                 duration_s: float, seeds: int = 3, schedulers: tuple[str, str] = ("online", "fcfs"),
                 bucket_noise: float = 0.0, predictions: Predictions | None = None, order_by: str = "rank") -> dict:
    """Every (rate, seed) under both schedulers; per rate the medians and the median ratios
    (mean E2E of B / A, goodput of A / B: above 1 means A is better)."""
    if len(schedulers) != 2:
        raise ValueError(f"an A/B takes two schedulers, got {list(schedulers)}")
    if not rates or min(rates) <= 0 or duration_s <= 0 or seeds < 1 or bucket_noise < 0:
        raise ValueError(f"need rates > 0 (got {rates}), duration > 0 (got {duration_s}), seeds >= 1 (got {seeds}) "
                         f"and bucket noise >= 0 (got {bucket_noise})")
    a, b = schedulers
    runs, summary = [], []
    for rate in rates:
        pairs = []
        for seed in range(seeds):
            pair = [simulate_load(runner, scheduler_config(config, s), workload, rate, duration_s,
                                  seed, bucket_noise, predictions, order_by, label=s) for s in (a, b)]
            runs += [asdict(r) for r in pair]
            pairs.append(pair)
        goodput_ratios = [ra.goodput_rps / rb.goodput_rps for ra, rb in pairs if rb.goodput_rps > 0]
        summary.append({
            "rate_rps": rate,
            a: _medians([p[0] for p in pairs]),
            b: _medians([p[1] for p in pairs]),
            "e2e_ratio": round(float(np.median([rb.mean_e2e_s / ra.mean_e2e_s for ra, rb in pairs])), 3),
            # NOTE: None when B met no SLO in any run (the ratio is unbounded, not a number)
            "goodput_ratio": round(float(np.median(goodput_ratios)), 3) if goodput_ratios else None,
        })
    return {"schedulers": [a, b], "duration_s": duration_s, "seeds": seeds, "bucket_noise": bucket_noise,
            "predictor": "oracle" if predictions is None else predictions.source, "order_by": order_by,
            "runner": runner.describe(), "summary": summary, "runs": runs}


def queued_order_gain(output_tokens: list[int], requests: int, slots: int, trials: int = 100, seed: int = 0) -> float:
    """The most an order can gain in the limit of overload: ``requests`` answers (drawn from
    ``output_tokens``) all queued at once and run ``slots`` at a time, each slot taking the next in
    line when its answer ends. Mean completion time in arrival (random) order over that of exact
    shortest-first, averaged over ``trials`` draws. Decode time only: it ignores prefill and how a
    step's time grows with the batch."""
    if requests < 1 or slots < 1 or trials < 1 or not output_tokens:
        raise ValueError(f"need requests, slots and trials >= 1 and some lengths (got {requests}, {slots}, {trials})")
    rng = np.random.default_rng(seed)
    lengths = np.asarray(output_tokens, dtype=np.float64)

    def mean_completion(order: np.ndarray) -> float:
        free = np.zeros(slots)
        done = np.empty(len(order))
        for i, n in enumerate(order):
            k = int(free.argmin())
            free[k] += n
            done[i] = free[k]
        return float(done.mean())

    ratios = []
    for _ in range(trials):
        draw = rng.choice(lengths, requests)
        ratios.append(mean_completion(draw) / mean_completion(np.sort(draw)))
    return round(float(np.mean(ratios)), 3)


def _medians(runs: list[LoadRun]) -> dict:
    keys = ("mean_e2e_s", "p90_ttft_s", "p50_tpot_ms", "slo_attainment", "goodput_rps", "output_tokens_per_s",
            "mean_running_batch")
    return {k: round(float(np.median([getattr(r, k) for r in runs])), 4) for k in keys}


def plot_ab(report: dict, path: str) -> None:
    """TPOT p50, goodput and mean E2E against the rate, one line per scheduler (a PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [row["rate_rps"] for row in report["summary"]]
    panels = (("p50_tpot_ms", "TPOT p50 (ms)"), ("goodput_rps", "goodput (req/s within both SLOs)"),
              ("mean_e2e_s", "mean E2E (s)"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for name in report["schedulers"]:
            ax.plot(rates, [row[name][key] for row in report["summary"]], marker="o", label=name)
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report['runner']['model']} on {report['runner']['hardware']}"[:120], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
