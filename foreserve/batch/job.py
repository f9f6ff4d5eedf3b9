"""The offline batch job: predict every row's output length on Ray Data, order rows by it,
generate on engine actors (``offline`` scheduler, ``reserve_predicted``: the engine code serving
uses), and write OpenAI batch output lines exactly once (``app/batch/io.py``).

Pipeline: the engine actors start loading → the driver pins the predictor version (the champion's
number, looked up once) → input rows through ``PredictStage`` (Ray Data ``map_batches`` over one
actor, batched MiniLM, that exact version) → ``plan_batches`` (sorted by predicted bound; S3:
similar lengths travel together) → ``EngineStage`` actors (one ``LLMEngine`` each; a batch is
admitted at once so the scheduler packs it by predicted length), each taking the next batch when it
finishes one.

Everything the job keeps is in its output store (a local folder or a store URI every node sees):
each batch's finished rows go to ``parts/<batch>/`` in chunks of at most ``FLUSH_ROWS`` rows. An
actor that dies (its process, or its node) is restarted by Ray up to ``MAX_RESTARTS`` times on any
node that has its resources, and its batch retried: the retry skips the rows that batch already
stored, so it regenerates at most one unstored chunk (and should a line be answered twice anyway,
``finalize`` keeps the first answer). An actor not up within ``start_timeout_s`` of its start or
restart (no node can take it, or its engine does not load) fails the job with a message naming it
and what it needs. A job that is stopped and run again with the same output skips every line a part
already answers, and keeps the predictor version its ``status.json`` records.

The actors are in ``foreserve/batch/stages.py``, started and kept busy by ``foreserve/batch/workers.py``. ``python -m foreserve.batch.job INPUT --output OUT``
is the Ray Job's entrypoint (``foreserve batch submit``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from app import paths
from app.batch.io import InputRow, ResultStore, error_row, read_input
from foreserve.batch.stages import PredictStage, running_app
from foreserve.batch.workers import START_TIMEOUT_S, StartDeadline, generate, start_workers
from app.config import load_pool_config
from app.runtime_env import process_defaults

logger = logging.getLogger(__name__)
WORKER_NICENESS = 15  # Ray's default for worker processes


def pin_predictor(predictor: str, recorded: dict | None = None) -> tuple[str, str]:
    """``(what PredictStage loads, version label)``, fixed for the whole job: a registry name
    (``champion``, a number) becomes the version number it points at now, looked up once here, so a
    stage that Ray Data starts again loads the same version; a directory or ``max`` stays as it is;
    a missing champion gives ``("max", "max-fallback")``. ``recorded``: the job's earlier
    ``status.json``; a job resumed with the same ``predictor`` keeps the version pinned then."""
    recorded = recorded or {}
    if recorded.get("predictor") == predictor and recorded.get("predictor_source") and recorded.get("predictor_version"):
        return str(recorded["predictor_source"]), str(recorded["predictor_version"])
    from predictor.loading import resolve_predictor

    store = paths.predictor_store()
    source, version = resolve_predictor(predictor, store)
    if (predictor == "champion" or predictor.isdigit()) and version.isdigit():
        # NOTE: looking the number up caches it on this machine: a stage here loads it without MLflow
        resolve_predictor(version, store)
        source = version
    return source, version


def url_of(request) -> str:
    """The batch line url of a row's request (``app.batch.io.SCHEMAS``)."""
    from app.batch.io import SCHEMAS

    return next(url for url, schema in SCHEMAS.items() if type(request) is schema)


def predict(todo: list[InputRow], predictor: str, version: str, threads: int, bound_quantile: float | None = None,
            tokenizer=None) -> list[dict]:
    """Every row with its predicted bucket and bound (at ``bound_quantile``, the offline pool's):
    Ray Data ``map_batches`` over one predictor actor that loads ``predictor`` (``pin_predictor``)."""
    import ray

    ctx = ray.data.DataContext.get_current()
    # NOTE: on a small node the driver's own work competes with the engines for cores; the job
    # has its own progress (tqdm, status.json)
    ctx.enable_progress_bars = False
    ctx.execution_options.verbose_progress = False
    items = [{"line": r.line, "custom_id": r.custom_id, "request": r.request.model_dump_json(),
              "url": url_of(r.request), "text": r.request.predictor_text(tokenizer)} for r in todo]
    # NOTE: no runtime_env on the stage (an actor with one of its own needs a worker started for
    # it: ~1 s more on the job's critical path here); the stage sets its own torch threads.
    ds = ray.data.from_items(items).map_batches(
        PredictStage, fn_constructor_kwargs={"predictor": predictor, "version": version, "threads": threads,
                                             "bound_quantile": bound_quantile},
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


def run_job(input_path: str | Path, out_dir: str | Path, replicas: int = 1, batch_size: int = 256,
            engine_overrides: dict | None = None, predictor: str = "champion", engine_cpus: float = 1.0,
            backend: str = "auto", app_name: str = "foreserve", progress: bool = True,
            node_resources: dict[str, float] | None = None, start_timeout_s: float = START_TIMEOUT_S) -> dict:
    """Run (or resume) a batch job in the current Ray cluster. Returns the summary also written to
    ``status.json``; ``results.jsonl`` holds one line per non-blank input line, in input order.

    ``input_path``: a local file or the URI of one object; ``out_dir``: a local folder or a store
    URI. ``backend``: ``actors`` (``replicas`` engine actors of the job's own, each also needing
    ``node_resources``), ``serve`` (the running app's offline pool) or ``auto`` (serve when that app
    runs in this cluster). ``start_timeout_s``: see ``StartDeadline``."""
    import ray
    from tqdm import tqdm

    overrides = {"scheduler": "offline", "allocation": "reserve_predicted", "tp_workers": "processes", **(engine_overrides or {})}
    engine = load_pool_config("offline", **overrides)
    if backend == "auto":
        backend = "serve" if running_app(app_name) else "actors"
    store = ResultStore(out_dir)
    rows = list(read_input(input_path, engine.model_id))
    answered = store.answered()
    done = set(answered)
    bad = [r for r in rows if r.error is not None and r.line not in done]
    store.writer().append_many([error_row(r) for r in bad])
    todo = [r for r in rows if r.error is None and r.line not in done]
    recorded = store.status()
    store.write_status(state="running", input=str(input_path), output=store.uri, backend=backend, rows_total=len(rows),
                       rows_resumed=len(done), errors=sum(r.error is not None for r in rows), started_at=time.time(),
                       finished_at=None, resumed_output_tokens=sum(r.output_tokens or 0 for r in answered.values()))
    t0 = time.perf_counter()
    version = recorded.get("predictor_version")
    if todo:
        engines = 1 if backend == "serve" else replicas
        # NOTE: the engine actors load while the predictor is pinned and the rows are predicted
        started = time.monotonic()
        workers = start_workers(backend, engines, engine, store.uri, engine_cpus, app_name, node_resources)
        try:
            source, version = pin_predictor(predictor, recorded)
            store.write_status(predictor=predictor, predictor_source=source, predictor_version=version)
            # NOTE: the job's own engines have loaded (~2 s) by the time the predictor actor has
            # started and loaded, so it predicts on an engine's threads; beside a Serve app, on one
            # thread, leaving the cores to the online pool
            threads = 1 if backend == "serve" else engine.torch_threads or os.cpu_count() or 1
            ids_prompts = any(not isinstance(getattr(r.request, "prompt", ""), str) for r in todo)
            tokenizer = None
            if ids_prompts:  # to decode token-id prompts for the predictor
                from app.engine.text.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(engine.model_path)
            predicted = predict(todo, source, version, threads, engine.bound_quantile, tokenizer)
            with tqdm(total=len(todo), unit="row", desc="batch", disable=not progress) as bar:
                generate(workers, plan_batches(predicted, batch_size, engines), bar.update, uuid.uuid4().hex[:8],
                         StartDeadline(workers, start_timeout_s, started))
        finally:
            for worker in workers:
                ray.kill(worker.actor)
    wall_s = time.perf_counter() - t0
    final = store.answered()
    results = store.finalize({r.line for r in rows}, final)
    # what this run generated and kept, counted from the parts (a retried batch skips rows an
    # earlier attempt of it had written)
    output_tokens = sum(r.output_tokens or 0 for line, r in final.items() if line not in done)
    summary = {"backend": backend, "rows": len(rows), "rows_resumed": len(done), "errors": len(bad), "ran": len(todo),
               "output_tokens": output_tokens, "wall_s": round(wall_s, 2),
               "output_tokens_per_s": round(output_tokens / wall_s, 2) if todo and wall_s > 0 else 0.0,
               "predictor_version": version, "results": results}
    store.write_status(state="succeeded", finished_at=time.time(), summary=summary)
    return summary


def _resource(text: str) -> tuple[str, float]:
    name, _, amount = text.partition("=")
    try:
        return name, float(amount or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=AMOUNT, e.g. gpu_node=0.01") from None


def main(argv: list[str] | None = None) -> int:
    """The Ray Job's entrypoint: runs in the cluster that submitted it (``RAY_ADDRESS`` set by Ray Jobs)."""
    p = argparse.ArgumentParser("python -m foreserve.batch.job", description="run one foreserve batch job in the current Ray cluster")
    p.add_argument("input", help="JSONL or Parquet: a local file or the URI of one object (s3://bucket/in.jsonl?...)")
    p.add_argument("--output", required=True, help="a folder or a store URI every node sees")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--predictor", default="champion")
    p.add_argument("--engine-cpus", type=float, default=1.0)
    p.add_argument("--engine", default="{}", help="JSON object of EngineConfig overrides")
    p.add_argument("--engine-resource", type=_resource, action="append", default=[], metavar="NAME=AMOUNT",
                   help="a custom Ray resource every engine actor also needs (repeatable)")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                   help=f"seconds an actor may take to be placed and loaded, at start or after a restart (default {START_TIMEOUT_S:.0f})")
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
                          args.engine_cpus, args.backend, args.app_name, progress=sys.stderr.isatty(),
                          node_resources=dict(args.engine_resource), start_timeout_s=args.start_timeout)
        if args.parquet:
            ResultStore(args.output).write_parquet()
    except Exception as exc:
        try:
            ResultStore(args.output).write_status(state="failed", finished_at=time.time(), message=f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - the job's own error is the one to report
            logger.exception("could not record the failure in %s", args.output)
        raise
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
