"""Batch jobs as Ray Jobs: submit, status, stop. Shared by ``foreserve batch`` and the Batch API.

The cluster is ``$RAY_API_SERVER_ADDRESS``/``$RAY_ADDRESS`` (a dashboard URL such as
``http://head:8265``) when set; else a local cluster that runs already (``foreserve serve`` starts
one with its dashboard, and a job submitted there uses the app's offline pool); else a new local
head node (``ray start --head``, which stays up after the command: ``ray stop`` ends it).
The job's entrypoint is ``python -m foreserve.batch.job`` with this interpreter: a remote cluster needs
foreserve installed at the same path, and input and output on storage every node sees.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

from app.runtime_env import JOB_ENV, env_vars

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class JobError(RuntimeError):
    """A job that cannot be submitted, found or stopped (the message says why)."""


def _address() -> str | None:
    return os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")


def ray_command(*args: str) -> list[str]:
    """``ray ARGS`` with the CLI of this interpreter's environment (a venv need not be on PATH)."""
    ray_bin = Path(sys.executable).with_name("ray")
    return [str(ray_bin) if ray_bin.exists() else "ray", *args]


def stop_local_cluster() -> None:
    """``ray stop``: ends the local head node that ``client(start=True)`` started."""
    subprocess.run(ray_command("stop"), capture_output=True)


def client(start: bool = True):
    """A Jobs API client for the configured or local cluster; starts a local head node if ``start``
    and none runs."""
    from ray.job_submission import JobSubmissionClient

    if not _address():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # NOTE: Ray 2.60's default token auth; see README
    try:
        return JobSubmissionClient(_address() or "auto")
    except (ConnectionError, ValueError, RuntimeError) as exc:
        if _address() or not start:
            raise JobError(f"no Ray cluster with a dashboard at {_address() or 'this machine'} ({exc})") from None
    args = ["start", "--head", "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--disable-usage-stats"]
    print("starting a local Ray cluster: ray " + " ".join(args), file=sys.stderr)
    proc = subprocess.run(ray_command(*args), capture_output=True, text=True, start_new_session=True)
    if proc.returncode != 0:
        raise JobError(f"`ray start --head` failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    deadline = time.monotonic() + 60
    while True:
        try:
            return JobSubmissionClient("http://127.0.0.1:8265")
        except ConnectionError:
            if time.monotonic() > deadline:
                raise JobError("the local Ray cluster started but its dashboard (Jobs API) did not answer in 60 s") from None
            time.sleep(1)


def submit(input_path: str | Path, output: str | Path, job_id: str | None = None, replicas: int = 1, tp: int = 1,
           backend: str = "auto", parquet: bool = False, extra_args: list[str] | None = None, jobs=None) -> str:
    """Submit a batch job; returns its id. Resubmitting an ended job's id with the same output resumes
    it: rows already written are skipped, none is written twice."""
    from app.batch.io import read_input

    input_path, output = Path(input_path).resolve(), Path(output).resolve()
    next(iter(read_input(input_path, "")), None)  # fail fast on an unreadable input, before any job exists
    jobs = jobs or client()
    job_id = job_id or f"batch-{uuid.uuid4().hex[:12]}"
    attempts = _attempts(jobs, job_id)
    if attempts:
        last = attempts[-1]
        if str(last.status) not in TERMINAL:
            raise JobError(f"job {job_id} is still {last.status}; stop it first (foreserve batch cancel {job_id})")
        old = (last.metadata or {}).get("output")
        if old and Path(old) != output:
            raise JobError(f"job {job_id} wrote to {old}; resubmit it with --output {old} to resume")
    args = [sys.executable, "-m", "foreserve.batch.job", str(input_path), "--output", str(output), "--replicas", str(replicas),
            "--tp", str(tp), "--backend", backend, *(["--parquet"] if parquet else []), *(extra_args or [])]
    env = env_vars(JOB_ENV)
    output.mkdir(parents=True, exist_ok=True)
    # NOTE: each (re)submission is its own Ray job, ``ID`` then ``ID.2``, ``ID.3``...: reusing a Ray
    # submission id right after a stop races with the old job's supervisor actor
    jobs.submit_job(entrypoint=shlex.join(args), submission_id=job_id if not attempts else f"{job_id}.{len(attempts) + 1}",
                    runtime_env={"env_vars": env}, metadata={"job_id": job_id, "output": str(output), "input": str(input_path)})
    return job_id


def _attempts(jobs, job_id: str) -> list:
    """The Ray jobs that ran foreserve job ``job_id``, oldest first."""
    mine = [j for j in jobs.list_jobs() if (j.metadata or {}).get("job_id") == job_id]
    return sorted(mine, key=lambda j: j.start_time or 0)


def _latest(jobs, job_id: str):
    attempts = _attempts(jobs, job_id)
    if not attempts:
        raise JobError(f"no batch job {job_id!r} in this Ray cluster")
    return attempts[-1]


def status(job_id: str, jobs=None) -> dict:
    """Ray's job state plus the job's own progress (rows done/total, output tokens/s)."""
    from app.batch.io import read_status

    jobs = jobs or client(start=False)
    info = _latest(jobs, job_id)
    output = (info.metadata or {}).get("output")
    report = {"job_id": job_id, "ray_job_id": info.submission_id, "ray_status": str(info.status), "message": info.message,
              "output": output}
    if output:
        report.update(read_status(output))
    return report


def stop(job_id: str, jobs=None) -> bool:
    jobs = jobs or client(start=False)
    return bool(jobs.stop_job(_latest(jobs, job_id).submission_id))


def wait(job_id: str, jobs=None, poll_s: float = 2.0, on_progress=None) -> dict:
    """Block until the job ends; ``on_progress(status)`` after each poll."""
    jobs = jobs or client(start=False)
    while True:
        report = status(job_id, jobs)
        if on_progress:
            on_progress(report)
        if report["ray_status"] in TERMINAL:
            return report
        time.sleep(poll_s)


def results_path(job_id: str, jobs=None) -> Path:
    report = status(job_id, jobs)
    path = Path(report["output"] or ".") / "results.jsonl"
    if report["ray_status"] != "SUCCEEDED" or not path.is_file():
        raise JobError(f"job {job_id} has no results yet ({report['ray_status']}; {report.get('rows_done', 0)}"
                       f"/{report.get('rows_total', '?')} rows done)")
    return path


def dumps(report: dict) -> str:
    return json.dumps(report, indent=1, default=str)
