"""The offline batch job: predict every row's output length on Ray Data, order rows by it,
generate on engine actors (``offline`` scheduler, ``reserve_predicted``: the engine code serving
uses), and write OpenAI batch output lines exactly once (``app/batch/io.py``).

Pipeline: the engine actors start loading → input rows through ``PredictStage`` (Ray Data
``map_batches`` over one actor, batched MiniLM; it resolves the predictor version once for the job) →
``plan_batches`` (sorted by predicted bound; S3: similar lengths travel together) →
``EngineStage`` actors (one ``LLMEngine`` each; a batch is admitted at once so the scheduler packs
it by predicted length), each taking the next batch when it finishes one. Each finished row is
appended to the actor's own part file as soon as it finishes. An actor killed mid-batch is
restarted by Ray and its batch retried: the retry skips rows a part already answers (and should one
be answered twice anyway, ``finalize`` keeps the first answer). A job that is stopped and run again
with the same output directory skips every line a part already answers.

The actors are in ``foreserve/batch/stages.py``. ``python -m foreserve.batch.job INPUT --output DIR`` is the Ray
Job's entrypoint (``foreserve batch submit``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from app.batch.io import InputRow, ResultStore, error_row, read_input, write_status
from foreserve.batch.stages import EngineStage, PredictStage, ServeStage, running_app
from app.config import EngineConfig, load_pool_config
from app.runtime_env import process_defaults

WORKER_NICENESS = 15  # Ray's default for worker processes


def predict(todo: list[InputRow], predictor: str, threads: int, bound_quantile: float | None = None) -> list[dict]:
    """Every row with its predicted bucket and bound (at ``bound_quantile``, the offline pool's):
    Ray Data ``map_batches`` over one predictor actor, which resolves ``predictor`` once (one
    version for the whole job)."""
    import ray

    ctx = ray.data.DataContext.get_current()
    # NOTE: on a small node the driver's own work competes with the engines for cores; the job
    # has its own progress (tqdm, status.json)
    ctx.enable_progress_bars = False
    ctx.execution_options.verbose_progress = False
    items = [{"line": r.line, "custom_id": r.custom_id, "request": r.request.model_dump_json(),
              "text": r.request.predictor_text()} for r in todo]
    # NOTE: no runtime_env on the stage (an actor with one of its own needs a worker started for
    # it: ~1 s more on the job's critical path here); the stage sets its own torch threads.
    ds = ray.data.from_items(items).map_batches(
        PredictStage, fn_constructor_kwargs={"predictor": predictor, "threads": threads, "bound_quantile": bound_quantile},
        compute=ray.data.ActorPoolStrategy(size=1), batch_size=64, num_cpus=0.25)
    return ds.take_all()


def plan_batches(rows: list[dict], batch_size: int, engines: int) -> list[list[dict]]:
    """Predicted rows cut into engine batches, in the order they should run.

    More rows than one round of engine batches: sorted by predicted bound and cut into
    ``batch_size`` slices (S3: similar lengths travel together, so each batch finishes evenly; the
    offline scheduler packs within one). One round: dealt out in bound order, one batch per
    engine, so every engine gets a like mix and they finish together."""
    rows = sorted(rows, key=lambda r: r["bound_tokens"])
    if len(rows) > batch_size * engines:
        return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    return [batch for batch in (rows[i::engines] for i in range(engines)) if batch]


def engine_resources(engine: EngineConfig, engine_cpus: float, cluster_gpus: float) -> dict[str, float]:
    """Ray resources of one engine actor: ``engine_cpus`` per rank, and its GPU when the engine runs
    on CUDA (``device`` cuda, or auto on a cluster with GPUs), so that Ray places it on a GPU node
    and hands it that GPU."""
    on_gpu = engine.device.startswith("cuda") or (engine.device == "auto" and cluster_gpus > 0)
    if on_gpu and engine.tensor_parallel_size > 1:
        raise ValueError("a batch engine with tensor_parallel_size > 1 on GPUs needs its ranks in a placement group, "
                         "which batch jobs do not make yet: use --backend serve (the offline pool's placement group) "
                         "or tensor_parallel_size 1")
    return {"num_cpus": engine_cpus * engine.tensor_parallel_size, "num_gpus": 1.0 if on_gpu else 0.0}


def start_workers(backend: str, count: int, engine: EngineConfig, out_dir: Path, engine_cpus: float, app_name: str) -> list:
    """The job's generation actors: ``EngineStage`` (an engine each) or one ``ServeStage``.

    Plain Ray actors, restarted when they die with their running batch retried (``run`` skips the
    rows a part already answers). Not a Ray Data stage: once the rows are predicted, nothing of
    Ray Data's executor polls beside the engines."""
    import ray

    stage = {"engine": engine.model_dump(mode="json"), "out_dir": str(out_dir)}
    if backend == "serve":
        actor = ray.remote(ServeStage).options(num_cpus=0.05, max_restarts=-1, max_task_retries=-1)
        return [actor.remote(**stage, app_name=app_name)]
    resources = engine_resources(engine, engine_cpus, ray.cluster_resources().get("GPU", 0.0))
    actor = ray.remote(EngineStage).options(**resources, max_restarts=-1, max_task_retries=-1)
    return [actor.remote(**stage) for _ in range(count)]


def generate(workers: list, batches: list[list[dict]], on_done) -> None:
    """Each worker takes the next batch as soon as it finishes one; ``on_done(rows)`` per batch."""
    import ray

    queue = list(reversed(batches))
    running = {w.run.remote(queue.pop()): w for w in workers if queue}
    while running:
        (ref,), _ = ray.wait(list(running), num_returns=1)
        worker = running.pop(ref)
        on_done(ray.get(ref))
        if queue:
            running[worker.run.remote(queue.pop())] = worker


def run_job(input_path: str | Path, out_dir: str | Path, replicas: int = 1, batch_size: int = 256,
            engine_overrides: dict | None = None, predictor: str = "champion", engine_cpus: float = 1.0,
            backend: str = "auto", app_name: str = "foreserve", progress: bool = True) -> dict:
    """Run (or resume) a batch job in the current Ray cluster. Returns the summary also written to
    ``status.json``; ``results.jsonl`` holds one line per non-blank input line, in input order.

    ``backend``: ``actors`` (``replicas`` engine actors of the job's own), ``serve`` (the running
    app's offline pool) or ``auto`` (serve when that app runs in this cluster)."""
    import ray
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = {"scheduler": "offline", "allocation": "reserve_predicted", "tp_workers": "processes", **(engine_overrides or {})}
    engine = load_pool_config("offline", **overrides)
    if backend == "auto":
        backend = "serve" if running_app(app_name) else "actors"
    store = ResultStore(out_dir)
    rows = list(read_input(input_path, engine.served_model_name))
    answered = store.answered()
    done = set(answered)
    bad = [r for r in rows if r.error is not None and r.line not in done]
    store.writer().append_many([error_row(r) for r in bad])
    todo = [r for r in rows if r.error is None and r.line not in done]
    write_status(out_dir, state="running", input=str(input_path), backend=backend, rows_total=len(rows), rows_resumed=len(done),
                 errors=sum(r.error is not None for r in rows), started_at=time.time(), finished_at=None,
                 resumed_output_tokens=sum(r.output_tokens or 0 for r in answered.values()))
    t0 = time.perf_counter()
    if todo:
        engines = 1 if backend == "serve" else replicas
        # NOTE: the engine actors load while the rows are predicted
        workers = start_workers(backend, engines, engine, out_dir, engine_cpus, app_name)
        try:
            # NOTE: the job's own engines have loaded (~2 s) by the time the predictor actor has
            # started, resolved its version and loaded, so it predicts on an engine's threads;
            # beside a Serve app, on one thread, leaving the cores to the online pool
            threads = 1 if backend == "serve" else engine.torch_threads or os.cpu_count() or 1
            predicted = predict(todo, predictor, threads, engine.bound_quantile)
            with tqdm(total=len(todo), unit="row", desc="batch", disable=not progress) as bar:
                generate(workers, plan_batches(predicted, batch_size, engines), bar.update)
        finally:
            for worker in workers:
                ray.kill(worker)
    wall_s = time.perf_counter() - t0
    final = store.answered()
    results = store.finalize({r.line for r in rows}, final)
    # what this run generated and kept, counted from the parts (a retried batch skips rows an
    # earlier attempt of it had written)
    output_tokens = sum(r.output_tokens or 0 for line, r in final.items() if line not in done)
    summary = {"backend": backend, "rows": len(rows), "rows_resumed": len(done), "errors": len(bad), "ran": len(todo),
               "output_tokens": output_tokens, "wall_s": round(wall_s, 2),
               "output_tokens_per_s": round(output_tokens / wall_s, 2) if todo and wall_s > 0 else 0.0,
               "results": str(results)}
    write_status(out_dir, state="succeeded", finished_at=time.time(), summary=summary)
    return summary


def write_parquet(results: Path) -> Path:
    """``results.parquet`` next to ``results.jsonl`` (bodies as JSON strings: their shape varies)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in results.read_text().splitlines()]
    for row in rows:
        for key in ("response", "error"):
            row[key] = None if row[key] is None else json.dumps(row[key])
    out = results.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def main(argv: list[str] | None = None) -> int:
    """The Ray Job's entrypoint: runs in the cluster that submitted it (``RAY_ADDRESS`` set by Ray Jobs)."""
    p = argparse.ArgumentParser("python -m foreserve.batch.job", description="run one foreserve batch job in the current Ray cluster")
    p.add_argument("input")
    p.add_argument("--output", required=True)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--predictor", default="champion")
    p.add_argument("--engine-cpus", type=float, default=1.0)
    p.add_argument("--engine", default="{}", help="JSON object of EngineConfig overrides")
    p.add_argument("--backend", choices=["auto", "actors", "serve"], default="auto")
    p.add_argument("--app-name", default="foreserve")
    p.add_argument("--parquet", action="store_true")
    args = p.parse_args(argv)
    process_defaults()
    import ray

    # NOTE: Ray runs its workers (the engines) at niceness 15 and a job's driver at 0, so the
    # driver's own start-up (Ray Data, the registry lookup) preempted the engine actors' loading
    # outright on a small node. The driver only coordinates: it takes the workers' priority.
    os.nice(max(0, WORKER_NICENESS - os.nice(0)))
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    try:
        overrides = {"tensor_parallel_size": args.tp, **json.loads(args.engine)}
        summary = run_job(args.input, args.output, args.replicas, args.batch_size, overrides, args.predictor,
                          args.engine_cpus, args.backend, args.app_name, progress=sys.stderr.isatty())
    except Exception as exc:
        write_status(Path(args.output), state="failed", finished_at=time.time(), message=f"{type(exc).__name__}: {exc}")
        raise
    if args.parquet:
        write_parquet(Path(summary["results"]))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
