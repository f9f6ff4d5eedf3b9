"""Batch jobs vs the engine benchmark, on the same rows and resources (``foreserve bench batch``).

The rows are the first N of the ShareGPT validation trace, each asked for its true length capped at
``max_tokens`` with ``ignore_eos`` (what ``bench throughput`` forces), so both sides generate the same
tokens. Side A is ``bench throughput``'s ``reserve_predicted`` row (engine in this process, the offline
scheduler); side B is a job through ``batch submit``'s path (Ray Jobs → Ray Data → one engine actor
with the same KV budget and threads), timed by the job itself from its start to its last row, so it
pays for what a job really does (reading, predicting, starting the actor, writing each row). Runs
alternate A, B, A, B… and the medians are compared. A last job has its engine actor SIGKILLed
halfway and must still answer every row once.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from tqdm import tqdm


def write_rows(path: Path, rows: int, max_tokens: int) -> int:
    """The benchmark's rows as a batch input file; returns their total output tokens."""
    from transformers import AutoTokenizer

    from app import paths
    from loadtests.bench.throughput import load_requests

    requests = load_requests(rows, max_tokens, AutoTokenizer.from_pretrained(paths.model_dir()))
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            body = {"messages": [{"role": "user", "content": r.user}], "max_tokens": r.output_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": r.request_id, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    return sum(r.output_tokens for r in requests)


def engine_actor_pid() -> int | None:
    """A batch job's engine actor worker process (Ray titles it ``ray::MapWorker(MapBatches(EngineStage))...``)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if any("EngineStage" in part for part in proc.info["cmdline"] or []):
            return proc.pid
    return None


def _check_once(results: Path, rows: int) -> dict:
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    numbers = [x["line"] for x in lines]
    return {"output_rows": len(lines), "input_rows": rows, "duplicates": len(numbers) - len(set(numbers)),
            "errors": sum(x["error"] is not None for x in lines), "exactly_once": numbers == list(range(1, rows + 1))}


def run_job(jobs, client, source: Path, out: Path, engine: dict, predictor: str, kill_at: int | None = None) -> dict:
    """One job through the Jobs API; with ``kill_at``, SIGKILL its engine actor once that many rows are done."""
    from app.batch.io import read_status

    extra = ["--batch-size", "1024", "--predictor", predictor, "--engine-cpus", "1", "--engine", json.dumps(engine)]
    job_id = jobs.submit(source, out, f"bench-{uuid.uuid4().hex[:8]}", backend="actors", extra_args=extra, jobs=client)
    killed: list[int] = []

    def killer() -> None:
        while not killed and jobs.status(job_id, client)["ray_status"] not in jobs.TERMINAL:
            if read_status(out).get("rows_done", 0) >= kill_at and (pid := engine_actor_pid()):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.5)

    thread = threading.Thread(target=killer, daemon=True) if kill_at else None
    if thread:
        thread.start()
    report = jobs.wait(job_id, client, poll_s=5)
    if thread:
        thread.join(5)
    if report["ray_status"] != "SUCCEEDED":
        raise RuntimeError(f"batch job {job_id} {report['ray_status']}: {report.get('message')} (ray job logs {report['ray_job_id']})")
    lines = [json.loads(x) for x in Path(report["summary"]["results"]).read_text().splitlines()]
    finished = sorted(x["response"]["body"]["created"] for x in lines if x["response"])
    startup_s = finished[0] - report["started_at"] if finished else None  # job start → first row done (second resolution)
    return {"job_id": job_id, "killed_engine_actor": bool(killed), "first_row_s": startup_s, **report["summary"]}


def run_batch_bench(rows: int = 64, max_tokens: int = 256, kv_tokens: int = 8192, predictor: str = "champion",
                    repeats: int = 1, kill: bool = True) -> dict:
    from app.batch import jobs
    from loadtests.bench.throughput import run_benchmark

    work = Path(tempfile.mkdtemp(prefix="foreserve-bench-batch-"))
    source = work / "rows.jsonl"
    tokens = write_rows(source, rows, max_tokens)
    # the engine bench's configuration (loadtests/throughput.py), for the job's engine actor
    engine = {"kv_cache_tokens": kv_tokens, "default_max_tokens": max_tokens, "max_model_len_tokens": max_tokens + 1024,
              "max_num_seqs": 256, "max_num_batched_tokens": 512, "torch_threads": os.cpu_count() or 1}
    try:
        started_here = False
        try:
            client = jobs.client(start=False)
        except jobs.JobError:
            client, started_here = jobs.client(start=True), True
        engine_rows, job_rows, first_rows = [], [], []
        for rep in range(repeats):
            bench = run_benchmark(["reserve_predicted"], rows, kv_tokens, max_tokens, predictor=predictor)
            engine_rows.append(bench["results"][0]["output_tokens_per_s"])
            tqdm.write(f"[{rep + 1}/{repeats}] bench throughput reserve_predicted: {engine_rows[-1]} tok/s")
            job = run_job(jobs, client, source, work / f"out-{rep}", engine, predictor)
            check = _check_once(Path(job["results"]), rows)
            if not check["exactly_once"] or job["output_tokens"] != tokens:
                raise RuntimeError(f"batch job {job['job_id']} answered wrongly: {check}, {job['output_tokens']} of {tokens} tokens")
            job_rows.append(job["output_tokens_per_s"])
            first_rows.append(job["first_row_s"])
            tqdm.write(f"[{rep + 1}/{repeats}] batch job: {job_rows[-1]} tok/s ({job['wall_s']} s, first row after {job['first_row_s']:.0f} s)")
        killed = None
        if kill:
            job = run_job(jobs, client, source, work / "out-killed", engine, predictor, kill_at=rows // 2)
            killed = {**_check_once(Path(job["results"]), rows), "killed_engine_actor": job["killed_engine_actor"],
                      "output_tokens_per_s": job["output_tokens_per_s"], "wall_s": job["wall_s"]}
            tqdm.write(f"killed run: {killed}")
    finally:
        if started_here:
            jobs.stop_local_cluster()
    a, b = statistics.median(engine_rows), statistics.median(job_rows)
    return {
        "config": {"rows": rows, "max_tokens": max_tokens, "kv_tokens": kv_tokens, "predictor": predictor,
                   "repeats": repeats, "output_tokens": tokens, "torch_threads": engine["torch_threads"]},
        "bench_throughput_tokens_per_s": engine_rows,
        "batch_job_tokens_per_s": job_rows,
        "ratio_batch_over_bench": round(b / a, 3),
        "batch_job_first_row_s": first_rows,
        "killed_run": killed,
        "work_dir": str(work),
    }
