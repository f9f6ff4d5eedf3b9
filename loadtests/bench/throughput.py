"""`foreserve bench throughput`: offline replay of the ShareGPT validation trace.

All policies run side by side in one process on the same requests and the same KV budget, each
request forced to its true output length (EOS at that length and never before, the standard
convention: ``ReplayRunner``), with the real model (or the simulated runner with
``--sim HARDWARE:MODEL``), plus the transformers and llama.cpp peers.
Only useful tokens count. Output: the benchmark JSON contract of DESIGN.md.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from app import paths
from app.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.clock import ModelledClock, WallClock
from app.engine.request import EngineRequest, Prediction, SamplingParams
from app.engine.runner import Runner
from app.engine.sim.replay import ReplayRunner
from loadtests.bench.hf_peers import PEERS as HF_PEERS, run_peer
from loadtests.bench.llama_cpp import PEERS as LLAMA_CPP_PEERS, run_llama_cpp
from predictor.base import LengthPredictor, MaxPredictor, OraclePredictor
from predictor.buckets import LengthBuckets

PEERS = HF_PEERS + LLAMA_CPP_PEERS
DEFAULT_SCHEDULER = {"reserve_max": "fcfs", "paged": "fcfs", "reserve_predicted": "offline", "oracle": "offline"}


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt: str  # chat-templated, what the engine runs
    user: str  # the user's message, what the length predictor reads
    prompt_token_ids: list[int]
    output_tokens: int  # true length, capped at max_tokens: every request generates exactly this


def load_requests(n: int, max_tokens: int, tokenizer=None, split: str = "validation") -> list[BenchRequest]:
    """The first ``n`` trace records (id order: deterministic). Without a tokenizer (simulator),
    prompt token ids are placeholders of the right length."""
    from app.prepare.traces import load_trace

    records = load_trace(split)
    if not records:
        raise RuntimeError(f"the {split} trace is empty; run `foreserve prepare`")
    out = []
    for i in range(n):
        rec = records[i % len(records)]  # the simulator may ask for more than the split holds
        ids = tokenizer.encode(rec.prompt, add_special_tokens=False) if tokenizer else [1] * rec.prompt_tokens
        out.append(BenchRequest(f"{rec.id}-{i}", rec.prompt, rec.user, ids, min(rec.output_tokens, max_tokens)))
    return out


def make_predictor(name: str, requests: list[BenchRequest], buckets: LengthBuckets,
                   bound_quantile: float | None = None) -> LengthPredictor:
    """``oracle`` | ``max`` | ``champion`` | a version | a directory; ``NAME:Q`` sets the bound quantile."""
    if ":" in name and name.rsplit(":", 1)[1].replace(".", "", 1).isdigit():
        name, q = name.rsplit(":", 1)
        bound_quantile = float(q)
    if name == "oracle":
        return OraclePredictor([(r.user, r.output_tokens) for r in requests], buckets)
    if name == "max":
        return MaxPredictor(buckets)
    from predictor.loading import load_predictor  # the learned predictor (MLflow registry)

    return load_predictor(name, buckets, bound_quantile=bound_quantile, store=paths.predictor_store())


def run_policy(
    config: EngineConfig,
    runner: Runner,
    num_blocks: int,
    requests: list[BenchRequest],
    predictor: LengthPredictor,
    label: str = "",
    name: str | None = None,
) -> dict:
    """Replay ``requests`` (all arriving at t=0) through one engine; return one result row
    (``name`` labels the row; default the allocation policy)."""
    name = name or config.allocation
    ids = {r.request_id: f"{label}{name}-{r.request_id}" for r in requests}
    replay = ReplayRunner(runner, {ids[r.request_id]: r.output_tokens for r in requests})  # each ends at its true length
    clock = ModelledClock() if runner.simulated else WallClock()
    engine = LLMEngine(config, replay, num_blocks, tokenizer=None, predictor=predictor, clock=clock)
    pred = predictor.predict([r.user for r in requests])
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(EngineRequest(
            prompt_token_ids=r.prompt_token_ids,
            sampling=SamplingParams(max_tokens=config.default_max_tokens, temperature=0.0),
            request_id=ids[r.request_id],
            prompt=r.prompt,
            prediction=Prediction(bucket=pred.buckets[i], bound_tokens=pred.bound_tokens[i], exact_tokens=r.output_tokens),
            detokenize=False,
        ))
    total = sum(r.output_tokens for r in requests)
    with tqdm(total=total, desc=f"{name:>17}", unit="tok", leave=False, mininterval=2.0) as bar:
        while engine.has_unfinished_requests():
            bar.update(len(engine.step()))
    real_wall_s = time.perf_counter() - t0
    stats = engine.stats()
    if stats.output_tokens != total:
        raise RuntimeError(f"{name}: generated {stats.output_tokens} tokens, expected {total}")
    wall_s = stats.forward_s if runner.simulated else real_wall_s
    return {
        "policy": name,
        "scheduler": config.scheduler,
        "wall_s": round(wall_s, 4),
        "output_tokens": stats.output_tokens,
        "output_tokens_per_s": round(stats.output_tokens / wall_s, 3),
        "requests_per_s": round(len(requests) / wall_s, 4),
        "mean_running_batch": round(stats.mean_running_batch, 2),
        "peak_kv_used_tokens": stats.peak_kv_used_tokens,
        "preemptions": stats.preemptions,
        "recomputed_tokens": stats.recomputed_tokens,
        "overflow_preemptions": stats.overflow_preemptions,
        "steps": stats.steps,
        "forward_s": round(stats.forward_s, 4),
        "outside_forward_frac": round(max(real_wall_s - stats.forward_s, 0.0) / real_wall_s, 4)
        if not runner.simulated
        else None,
        "sim_real_s": round(real_wall_s, 2) if runner.simulated else None,
    }


def median_rows(rows: list[dict]) -> dict:
    """Median of repeated runs of one policy (numeric fields), keeping the per-run throughputs."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = [r[key] for r in rows if r.get(key) is not None]
            out[key] = statistics.median(vals)
    out["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in rows]
    return out


def build_runner(config: EngineConfig, sim: str | None, tp: int) -> tuple[Runner, int, object]:
    """(runner, pool blocks, tokenizer) for the real model or the simulator."""
    if sim:
        from app.engine.sim.profiles import parse_sim_spec
        from app.engine.sim.runner import SimRunner

        hardware, model = parse_sim_spec(sim)
        runner = SimRunner(hardware, model, tp)
        num_blocks = runner.kv_budget_bytes() // (runner.kv_bytes_per_token * config.block_size_tokens)
        return runner, int(num_blocks), None
    from app.engine.model.arch import arch_config
    from app.engine.model.hf_runner import HFRunner

    num_blocks = config.kv_pool_blocks(HFRunner.kv_bytes_per_token(arch_config(config.model_path)[1], config.cache_dtype))
    if tp > 1:
        from app.engine.parallel.tp import TPRunner

        runner = TPRunner(config, num_blocks)
    else:
        runner = HFRunner(config, num_blocks)
    return runner, num_blocks, runner.tokenizer


def ratios(results: list[dict]) -> dict:
    tps = {r["policy"]: r["output_tokens_per_s"] for r in results}
    rec = {r["policy"]: r["recomputed_tokens"] for r in results}
    out = {}
    ours = [p for p in tps if p not in PEERS and p != "oracle" and "@" not in p]
    if "reserve_predicted" in tps:
        for other in ("reserve_max", "paged", "oracle"):
            if other in tps:
                out[f"reserve_predicted_vs_{other}"] = round(tps["reserve_predicted"] / tps[other], 3)
        if "paged" in rec:
            out["recomputed_tokens_vs_paged"] = round(rec["reserve_predicted"] / max(rec["paged"], 1), 3)
        for other in (p for p in tps if p.startswith("reserve_predicted@")):
            out[f"reserve_predicted_vs_{other}"] = round(tps["reserve_predicted"] / tps[other], 3)
    if ours:
        best = max(ours, key=tps.get)
        out["best_policy"] = best
        for peer in PEERS:
            if peer in tps:
                out[f"best_vs_{peer}"] = round(tps[best] / tps[peer], 3)
    return out


def run_benchmark(
    policies: list[str],
    num_requests: int,
    kv_tokens: int,
    max_tokens: int,
    predictor: str = "oracle",
    bound_quantile: float | None = None,
    sim: str | None = None,
    tp: int = 1,
    repeats: int = 1,
    scheduler: str | None = None,
    block_size_tokens: int = 16,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    step_trace_dir: str | None = None,
) -> dict:
    """Every policy and peer of ``policies`` on the same requests; ``step_trace_dir`` writes each
    engine row's step trace into ``DIR/<repeat>-<row>/``."""
    base = EngineConfig(
        kv_cache_tokens=kv_tokens,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size_tokens=block_size_tokens,
        default_max_tokens=max_tokens,
        max_model_len_tokens=max_tokens + 1024,
        max_num_seqs=1024 if sim else 256,
        # NOTE: default 512 on this CPU (a step's cost grows with its tokens from ~16 on), 8192 on a
        # simulated GPU (steps stay memory-bound up to ~200-300 tokens there)
        max_num_batched_tokens=(8192 if sim else 512) if max_num_batched_tokens is None else max_num_batched_tokens,
        tensor_parallel_size=tp,
    )
    runner, num_blocks, tokenizer = build_runner(base, sim, tp)
    try:
        requests = load_requests(num_requests, max_tokens, tokenizer)
        buckets = LengthBuckets(max_tokens=max_tokens, num_buckets=base.num_buckets)
        # NOTE: "champion,oracle" runs reserve_predicted with the champion (row reserve_predicted)
        # and again with each further predictor (row reserve_predicted@oracle), side by side.
        names = [p.strip() for p in predictor.split(",") if p.strip()]
        # NOTE: a learned predictor's bound at the engine's bound_quantile (what a pool reserves)
        # unless --bound-quantile or NAME:Q names another
        quantile = base.bound_quantile if bound_quantile is None else bound_quantile
        preds = {n: make_predictor(n, requests, buckets, quantile) for n in names}
        pred = preds[names[0]]
        # (row name, allocation policy, predictor) for every engine row
        runs = [(p, p, pred) for p in policies if p not in PEERS]
        if "reserve_predicted" in policies:
            runs += [(f"reserve_predicted@{n}", "reserve_predicted", preds[n]) for n in names[1:]]
        rows: dict[str, list[dict]] = {p: [] for p in [*policies, *(r[0] for r in runs)]}
        for rep in range(repeats):  # NOTE: interleaved, so drift on a noisy machine hits all alike
            for row_name, policy, row_pred in runs:
                config = base.model_copy(update={
                    "allocation": policy,
                    "scheduler": scheduler or DEFAULT_SCHEDULER[policy],
                    "step_trace_dir": f"{step_trace_dir}/{rep}-{row_name}" if step_trace_dir else None,
                })
                rows[row_name].append(run_policy(config, runner, num_blocks, requests, row_pred, label=f"{rep}-", name=row_name))
                tqdm.write(f"[{rep + 1}/{repeats}] {row_name}: {rows[row_name][-1]['output_tokens_per_s']} tok/s")
            for peer in (p for p in policies if p in PEERS):
                kv = num_blocks * block_size_tokens
                if peer in LLAMA_CPP_PEERS:
                    threads = base.torch_threads or torch.get_num_threads()
                    rows[peer].append(run_llama_cpp(peer, requests, kv, max_tokens, threads))
                else:
                    rows[peer].append(run_peer(peer, runner, requests, kv, max_tokens))
                tqdm.write(f"[{rep + 1}/{repeats}] {peer}: {rows[peer][-1]['output_tokens_per_s']} tok/s")
    finally:
        runner.shutdown()
    results = [median_rows(rows[p]) for p in rows]
    return {
        "config": {
            "requests": num_requests,
            "kv_tokens": num_blocks * block_size_tokens,
            "max_tokens": max_tokens,
            "predictor": predictor,
            "predictor_version": getattr(pred, "version", None),
            "bound_quantile": getattr(pred, "bound_quantile", None),
            "sim": sim,
            "tp": tp,
            "dtype": base.weights_dtype,
            "kv_cache_dtype": base.cache_dtype,
            "repeats": repeats,
            "block_size_tokens": block_size_tokens,
            "max_num_batched_tokens": base.max_num_batched_tokens,
            "trace": "sharegpt validation split",
        },
        "results": results,
        "ratios": ratios(results),
    }
