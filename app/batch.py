"""The offline batch job: predict every row's output length on Ray Data, order rows by it,
generate on engine actors (``offline`` scheduler, ``reserve_predicted``: the engine code serving
uses), and write OpenAI batch output lines exactly once (``app/batch_io.py``).

Pipeline: the engine actors start loading → input rows through ``PredictStage`` (Ray Data
``map_batches`` over an actor, batched MiniLM; the predictor version is pinned once for the job) →
``plan_batches`` (sorted by predicted bound; S3: similar lengths travel together) →
``EngineStage`` actors (one ``LLMEngine`` each; a batch is admitted at once so the scheduler packs
it by predicted length), each taking the next batch when it finishes one. Each finished row is
appended to the actor's own part file as soon as it finishes. An actor killed mid-batch is
restarted by Ray and its batch retried: the retry skips rows a part already answers (and should one
be answered twice anyway, ``finalize`` keeps the first answer). A job that is stopped and run again
with the same output directory skips every line a part already answers.

``python -m app.batch INPUT --output DIR`` is the Ray Job's entrypoint (``foreserve batch submit``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

from app.api.errors import APIError
from app.batch_io import InputRow, ResultRow, ResultStore, error_row, ok_row, read_input, write_json
from app.config import EngineConfig, load_pool_config

STATUS_FILE = "status.json"
WORKER_NICENESS = 15  # Ray's default for worker processes


class PredictStage:
    """Ray Data actor: adds ``bucket``, ``bound_tokens`` and ``predictor_version`` columns.

    ``source``/``version``: the predictor the driver resolved once for the whole job
    (``predictor.loading.resolve_predictor``), so every row and every restarted actor uses one version."""

    def __init__(self, source: str, version: str, threads: int = 1) -> None:
        t0 = time.perf_counter()
        from app.engine.runner import on_short_lived_thread
        from predictor.loading import load_predictor_or_max

        # NOTE: Ray Data calls __call__ on another thread than __init__: see on_short_lived_thread
        self.predictor = on_short_lived_thread(lambda: load_predictor_or_max(source, version=version))
        self.threads = threads
        print(f"predictor {self.predictor.version} ready in {time.perf_counter() - t0:.1f} s", flush=True)

    def __call__(self, batch: dict) -> dict:
        import torch

        t0 = time.perf_counter()
        torch.set_num_threads(self.threads)  # NOTE: per calling thread (OpenMP), like the runner's
        pred = self.predictor.predict(list(batch["text"]))
        print(f"predicted {len(pred.buckets)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
        batch["bucket"] = list(pred.buckets)
        batch["bound_tokens"] = list(pred.bound_tokens)
        batch["predictor_version"] = [str(self.predictor.version)] * len(pred.buckets)
        return batch


def completion_body(request_id: str, model: str, text: str, prompt_tokens: int, output_tokens: int,
                    finish_reason: str | None) -> dict:
    """A finished answer as an OpenAI chat completion (with usage)."""
    from app.api.schemas import ChatCompletion, Choice, ResponseMessage, Usage

    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=output_tokens, total_tokens=prompt_tokens + output_tokens)
    reason = "length" if finish_reason == "length" else "stop"
    return ChatCompletion(id=request_id, model=model, usage=usage, service_tier="flex",
                          choices=[Choice(message=ResponseMessage(content=text), finish_reason=reason)]).model_dump()


def _rows(batch: list[dict], skip: set[int]):
    """(row, bucket, bound, predictor text, predictor version) for every predicted row of a batch
    that is not in ``skip`` (lines some part already answers: a retried batch after a crash)."""
    from app.api.schemas import ChatCompletionRequest

    for item in batch:
        if int(item["line"]) in skip:
            continue
        row = InputRow(int(item["line"]), str(item["custom_id"]), ChatCompletionRequest.model_validate_json(item["request"]))
        yield row, int(item["bucket"]), int(item["bound_tokens"]), str(item["text"]), str(item["predictor_version"])


def _sampling(body, max_tokens: int):
    from app.engine.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                          stop=body.stop_list, ignore_eos=body.ignore_eos)


class EngineStage:
    """Engine actor: runs batches of predicted rows through its own ``LLMEngine``; each row's
    result is on disk as soon as it finishes, all of them before ``run`` returns."""

    def __init__(self, engine: dict, out_dir: str) -> None:
        t0 = time.perf_counter()
        from app.engine.engine import LLMEngine
        from predictor.feedback import FeedbackWriter

        self.config = EngineConfig.model_validate(engine)
        self.engine = LLMEngine.from_config(self.config, feedback=FeedbackWriter())
        print(f"engine ready in {time.perf_counter() - t0:.1f} s ({self.engine.pool.capacity_tokens} KV tokens)", flush=True)
        self.store = ResultStore(out_dir)
        self.results = self.store.writer()

    def ready(self) -> int:
        return self.engine.pool.capacity_tokens

    def run(self, batch: list[dict]) -> int:
        """Generate every row of ``batch`` not answered yet; returns the number of rows in it."""
        from app.api.prompt import chat_prompt

        config, rows = self.config, {}
        for row, bucket, bound, text, version in _rows(batch, self.store.done_lines()):
            try:
                ids, max_tokens = chat_prompt(self.engine.tokenizer, row.request, config.max_model_len_tokens,
                                              config.default_max_tokens)
                req = self.engine.add_request(ids, _sampling(row.request, max_tokens), request_id=f"batch-{uuid.uuid4().hex}",
                                              tier="offline", prediction=(bucket, None, bound), predictor_text=text, stream_text=False,
                                              predictor_version=version)
            except (APIError, ValueError) as exc:  # too long for the context or for this replica's KV
                row.error = f"line {row.line}: {exc}"
                self.results.append(error_row(row))
                continue
            rows[req.request_id] = (row, bound, [])
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                row, bound, texts = rows[out.request_id]
                texts.append(out.text_delta)
                if out.finished:
                    body = completion_body(out.request_id, row.request.model, "".join(texts), out.num_prompt_tokens,
                                           out.num_output_tokens, out.finish_reason)
                    self.results.append(ok_row(row, body, bound))
        return len(batch)  # NOTE: progress only; the results are in the part files


SERVE_ATTEMPTS = 3  # a row whose offline replica goes away under it is sent again this many times in all


class ServeStage:
    """Actor that sends every row of a batch to a running foreserve app's offline pool (whose
    replicas run the same engine, and whose router and autoscaler see the batch's load) at once."""

    def __init__(self, engine: dict, out_dir: str, app_name: str) -> None:
        from ray import serve
        from transformers import AutoTokenizer

        self.config = EngineConfig.model_validate(engine)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
        self.app_name = app_name
        self.pool = serve.get_deployment_handle("offline", app_name).options(stream=True)
        self.store = ResultStore(out_dir)
        self.results = self.store.writer()

    def _one(self, row: InputRow, bucket: int, bound: int, text: str, version: str) -> ResultRow:
        from app.api.prompt import chat_prompt
        from deployments.engine_server import GenerateRequest

        config = self.config
        try:
            ids, max_tokens = chat_prompt(self.tokenizer, row.request, config.max_model_len_tokens, config.default_max_tokens)
        except APIError as exc:
            row.error = f"line {row.line}: {exc}"
            return error_row(row)
        request = GenerateRequest(request_id=f"batch-{uuid.uuid4().hex}", prompt_token_ids=ids, num_prompt_tokens=len(ids),
                                  sampling=_sampling(row.request, max_tokens), prediction=(bucket, None, bound),
                                  predictor_text=text, predictor_version=version)
        from ray.exceptions import ActorUnavailableError, RayActorError

        from deployments.pool_gate import wait_until_up

        for attempt in range(1, SERVE_ATTEMPTS + 1):
            texts, last = [], None
            if attempt > 1:  # NOTE: the replica went away: the pool may have yielded to online
                wait_until_up(self.app_name, "offline")
            try:
                for item in self.pool.generate.remote(request.model_dump()):
                    if "error" in item:
                        row.error = f"line {row.line}: {item['error']['message']}"
                        return error_row(row)
                    texts.append(item["text"])
                    last = item
                break
            except (RayActorError, ActorUnavailableError):
                # NOTE: the replica was drained by a scale-down (or died): requeue the row, recompute it
                if attempt == SERVE_ATTEMPTS:
                    raise
        body = completion_body(request.request_id, row.request.model, "".join(texts), last["prompt_tokens"],
                               last["completion_tokens"], last["finish_reason"])
        return ok_row(row, body, bound)

    def ready(self) -> int:
        return 0

    def run(self, batch: list[dict]) -> int:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from deployments.pool_gate import wait_until_up

        rows = list(_rows(batch, self.store.done_lines()))
        if rows:  # NOTE: one controller query per batch, not per row: do not wake a pool yielded to online
            wait_until_up(self.app_name, "offline")
        with ThreadPoolExecutor(max_workers=len(rows) or 1) as pool:
            for future in as_completed([pool.submit(self._one, *args) for args in rows]):
                self.results.append(future.result())
        return len(batch)


def running_app(app_name: str = "foreserve") -> bool:
    """Whether this Ray cluster runs a foreserve Serve app with an offline pool (checked without
    starting Serve)."""
    import ray

    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    if not any("SERVE_CONTROLLER" in name for name in names):
        return False
    from ray import serve

    app = serve.status().applications.get(app_name)
    return app is not None and "offline" in app.deployments and app.status == "RUNNING"


def write_status(out_dir: Path, **fields) -> None:
    """``status.json`` in the output directory (what ``foreserve batch status`` reads), replaced atomically."""
    path = Path(out_dir) / STATUS_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(fields, updated_at=time.time())
    write_json(path, old)


def read_status(out_dir: str | Path) -> dict:
    """The job's status plus live progress counted from the part files (rows land there as they finish)."""
    out_dir = Path(out_dir)
    path = out_dir / STATUS_FILE
    status = json.loads(path.read_text()) if path.is_file() else {}
    answered = ResultStore(out_dir).answered()
    status["rows_done"] = len(answered)
    status["rows_failed"] = sum(r.error is not None for r in answered.values())
    tokens = sum(r.output_tokens or 0 for r in answered.values()) - status.get("resumed_output_tokens", 0)
    started, ended = status.get("started_at"), status.get("finished_at") or time.time()
    if started and tokens > 0:
        status["output_tokens_per_s"] = round(tokens / max(ended - started, 1e-9), 2)
    return status


def predict(todo: list[InputRow], predictor: str, threads: int) -> list[dict]:
    """Every row with its predicted bucket and bound: Ray Data ``map_batches`` over a predictor
    actor, with the predictor resolved once here (one version for the whole job)."""
    import ray

    from predictor.loading import resolve_predictor

    source, version = resolve_predictor(predictor)
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
        PredictStage, fn_constructor_kwargs={"source": source, "version": version, "threads": threads},
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
    actor = ray.remote(EngineStage).options(num_cpus=engine_cpus * engine.tensor_parallel_size,
                                            max_restarts=-1, max_task_retries=-1)
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
            # NOTE: one thread: the prediction runs while the engines load (a 2-thread predictor
            # beside a loading engine oversubscribed this 2-core machine: the engine's first step
            # came later); beside a Serve app it leaves the cores to the online pool
            predicted = predict(todo, predictor, 1)
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
    p = argparse.ArgumentParser("python -m app.batch", description="run one foreserve batch job in the current Ray cluster")
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
