"""Batch jobs as Ray Jobs: submit, status, stop. Shared by ``foreserve batch`` and the Batch API.

The Jobs API (the dashboard on the cluster's head) is found, in this order (``dashboard_url``):

- ``$RAY_API_SERVER_ADDRESS``, or ``$RAY_ADDRESS`` when it is a dashboard URL (``http://head:8265``);
- inside a process of a Ray cluster (a Serve replica, a task): the dashboard address the head put
  in the cluster's GCS, where a dashboard bound to the head's loopback is reached at the head's
  address (the GCS's host) from every other node;
- else ``$RAY_ADDRESS`` (a cluster address) or a local cluster that runs already (``foreserve serve``
  starts one with its dashboard, and a job submitted there uses the app's offline pool); else a new
  local head node (``ray start --head``, which stays up after the command: ``ray stop`` ends it).

The job's entrypoint is ``python -m foreserve.batch.job`` with this interpreter: a remote cluster needs
foreserve installed at the same path. Input and output are local paths or store URIs
(``predictor.object_store``: ``s3://…``); on a cluster of several machines they must be URIs (or
paths on storage) every node sees.
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

from app.ray_local import dead_local_cluster
from app.runtime_env import JOB_ENV, env_vars
from predictor.object_store import ObjectStore

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
SUBMISSIONS = 3  # the Ray jobs one batch may take: a job lost with its driver is submitted again (``lost``)
RESULTS = "results.jsonl"  # one answer per input line, in a job's output (app/batch/io.py)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
NO_AGENT = "No available agent"  # Ray's Jobs API, before the head's job agent registers
AGENT_WAIT_TRIES = 6  # each waits about 10 s in Ray's Jobs API


class JobError(RuntimeError):
    """A job that cannot be submitted, found or stopped (the message says why)."""


def _address() -> str | None:
    return os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")


def _split(address: str) -> tuple[str, str]:
    """``host:port`` (``[v6]:port`` too) → (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _url(host: str, port: str) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def reachable_dashboard(reported: str, head_host: str, node_ip: str) -> str:
    """The Jobs API's URL for a process on node ``node_ip`` of a cluster whose head (GCS host)
    is ``head_host`` and whose dashboard reported ``reported`` (``host:port``). A dashboard on the
    head's loopback is the head itself: kept on the head, the head's address from any other node."""
    host, port = _split(reported.partition("://")[2] or reported)
    if host in LOOPBACK and node_ip != head_host:
        host = head_host
    return _url(host, port)


def _cluster_dashboard() -> str | None:
    """The Jobs API's URL when this process is part of a Ray cluster (``ray.init`` ran, or a Serve
    replica or task); None otherwise. JobError if the cluster runs no dashboard."""
    ray = sys.modules.get("ray")  # NOTE: a process that never imported Ray is no part of a cluster
    if ray is None or not ray.is_initialized():
        return None
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    # NOTE: where the head's dashboard puts its address (Ray's ray_constants.DASHBOARD_ADDRESS, in
    # namespace KV_NAMESPACE_DASHBOARD): its bind host (or the head's IP when bound to all) and port
    reported = internal_kv._internal_kv_get("dashboard", namespace="dashboard")
    head_host, _ = _split(ray.get_runtime_context().gcs_address)
    if not reported:
        raise JobError(f"the Ray cluster at {head_host} runs no dashboard (the Jobs API): start its head with "
                       "`ray start --head --include-dashboard true --dashboard-host 0.0.0.0`")
    return reachable_dashboard(reported.decode(), head_host, ray.util.get_node_ip_address())


def _explicit_dashboard() -> str | None:
    """``$RAY_API_SERVER_ADDRESS``, or ``$RAY_ADDRESS`` when it is a dashboard URL (``http(s)://``)."""
    address = os.environ.get("RAY_ADDRESS") or ""
    return os.environ.get("RAY_API_SERVER_ADDRESS") or (address if address.startswith(("http://", "https://")) else None)


def dashboard_url() -> str | None:
    """The Jobs API's URL when it is known without looking for a local cluster: an explicit one
    (``_explicit_dashboard``), else this process's cluster's (``_cluster_dashboard``); None when
    neither applies."""
    return _explicit_dashboard() or _cluster_dashboard()


def ray_command(*args: str) -> list[str]:
    """``ray ARGS`` with the CLI of this interpreter's environment (a venv need not be on PATH)."""
    ray_bin = Path(sys.executable).with_name("ray")
    return [str(ray_bin) if ray_bin.exists() else "ray", *args]


def stop_local_cluster() -> None:
    """``ray stop``: ends the local head node that ``client(start=True)`` started."""
    subprocess.run(ray_command("stop"), capture_output=True)


def client(start: bool = True):
    """A Jobs API client for the cluster the module docstring names; starts a local head node if
    ``start``, this process is no part of a cluster, and none runs."""
    from ray.job_submission import JobSubmissionClient

    if not _address():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # NOTE: Ray 2.60's default token auth; see README
    explicit = _explicit_dashboard()
    url = explicit or _cluster_dashboard()
    # NOTE: Ray's current-cluster file naming a cluster that died uncleanly: "auto" would retry its
    # dead GCS for ~40 s and raise an RpcError; ask its port first (app/ray_local.py)
    dead = None if url or _address() else dead_local_cluster()
    if dead is not None:
        if not start:
            raise JobError(f"no Ray cluster runs here: the local one at {dead} is gone (its processes died "
                           "without `ray stop`); `foreserve batch submit` starts a fresh one")
        print(f"the local Ray cluster at {dead} is gone; starting a fresh one", file=sys.stderr)
    else:
        try:
            return JobSubmissionClient(url or _address() or "auto")
        except (ConnectionError, ValueError, RuntimeError) as exc:
            if url or _address() or not start:
                hint = "" if explicit or not url else (
                    "; this cluster's dashboard must listen where its nodes reach it: start the head with "
                    "--dashboard-host 0.0.0.0, or set RAY_API_SERVER_ADDRESS=http://HEAD:PORT")
                raise JobError(f"no Ray Jobs API at {url or _address() or 'this machine'} ({exc}){hint}") from None
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
    """Submit a batch job; returns its id. ``input_path``: a local file or the URI of one object in a
    store; ``output``: a local folder or a store URI (the job's ``status.json``, ``parts/`` and
    ``results.jsonl`` go there). Resubmitting an ended job's id with the same output resumes it: rows
    already written are skipped, none is written twice."""
    from app.batch.io import read_input

    input_path, output = location(input_path), location(output)
    next(iter(read_input(input_path, "")), None)  # fail fast on an unreadable input, before any job exists
    jobs = jobs or client()
    job_id = job_id or f"batch-{uuid.uuid4().hex[:12]}"
    attempts = _attempts(jobs, job_id)
    if attempts:
        last = attempts[-1]
        if str(last.status) not in TERMINAL:
            raise JobError(f"job {job_id} is still {last.status}; stop it first (foreserve batch cancel {job_id})")
        old = (last.metadata or {}).get("output")
        if old and location(old) != output:
            raise JobError(f"job {job_id} wrote to {old}; resubmit it with --output {old} to resume")
    args = [sys.executable, "-m", "foreserve.batch.job", str(input_path), "--output", str(output), "--replicas", str(replicas),
            "--tp", str(tp), "--backend", backend, *(["--parquet"] if parquet else []), *(extra_args or [])]
    env = env_vars(JOB_ENV)
    if "://" not in output:
        Path(output).mkdir(parents=True, exist_ok=True)
    # NOTE: each (re)submission is its own Ray job, ``ID`` then ``ID.2``, ``ID.3``...: reusing a Ray
    # submission id right after a stop races with the old job's supervisor actor
    _submit_when_agent_up(jobs, entrypoint=shlex.join(args), runtime_env={"env_vars": env},
                          submission_id=job_id if not attempts else f"{job_id}.{len(attempts) + 1}",
                          metadata={"job_id": job_id, "output": output, "input": input_path})
    return job_id


def _submit_when_agent_up(jobs, **job) -> None:
    """``jobs.submit_job(**job)``, tried again while the head's job agent is not registered yet.
    Ray's Jobs API waits 10 s for it, then answers 500 "No available agent to submit job, please try
    again later" and submits nothing: a head that has just started, on busy cores, can take longer."""
    for attempt in range(1, AGENT_WAIT_TRIES + 1):
        try:
            jobs.submit_job(**job)
            return
        except RuntimeError as exc:
            if NO_AGENT not in str(exc):
                raise
            if attempt == AGENT_WAIT_TRIES:
                raise JobError(f"the Ray head's job agent did not come up in {AGENT_WAIT_TRIES} tries of about 10 s "
                               f"(Ray: {exc}); is its dashboard agent running? (`ray status`, its dashboard_agent.log)") from None
            time.sleep(1)


def location(where: str | Path) -> str:
    """A job's input or output as the job is handed it: a store URI as it is, a local path absolute."""
    text = str(where)
    return text if "://" in text else str(Path(text).expanduser().resolve())


def _attempts(jobs, job_id: str) -> list:
    """The Ray jobs that ran foreserve job ``job_id``, oldest first."""
    mine = [j for j in jobs.list_jobs() if (j.metadata or {}).get("job_id") == job_id]
    return sorted(mine, key=lambda j: j.start_time or 0)


def _submitted(jobs, job_id: str) -> list:
    """``_attempts``, or JobError if Ray knows no job ``job_id``."""
    attempts = _attempts(jobs, job_id)
    if not attempts:
        raise JobError(f"no batch job {job_id!r} in this Ray cluster")
    return attempts


def _latest(jobs, job_id: str):
    return _submitted(jobs, job_id)[-1]


def status(job_id: str, jobs=None) -> dict:
    """Ray's job state plus the job's own progress (rows done/total, output tokens/s)."""
    from app.batch.io import read_status

    jobs = jobs or client(start=False)
    attempts = _submitted(jobs, job_id)
    info = attempts[-1]
    output = (info.metadata or {}).get("output")
    report = {"job_id": job_id, "ray_job_id": info.submission_id, "ray_status": str(info.status), "message": info.message,
              "output": output, "submissions": len(attempts), "driver_exit_code": getattr(info, "driver_exit_code", None)}
    if output:
        report.update(read_status(output))
    return report


def lost(report: dict) -> bool:
    """Whether a job's last Ray job (``status``) ended without failing by itself: its driver killed
    by a signal (an OOM kill, a stop of its node) or its supervisor gone with its node. A job that
    exited with an error of its own (exit code 1 or 2) is not lost."""
    code = report.get("driver_exit_code")
    return report.get("ray_status") == "FAILED" and (code is None or code < 0 or code >= 128)


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


def _results(job_id: str, jobs=None) -> tuple[ObjectStore, str]:
    """The store of a finished job's output, and the key of its ``results.jsonl``."""
    report = status(job_id, jobs)
    output = ObjectStore(report["output"] or ".")
    if report["ray_status"] != "SUCCEEDED" or not output.exists(RESULTS):
        raise JobError(f"job {job_id} has no results yet ({report['ray_status']}; {report.get('rows_done', 0)}"
                       f"/{report.get('rows_total', '?')} rows done)")
    return output, RESULTS


def results_path(job_id: str, jobs=None) -> Path:
    """A finished job's ``results.jsonl`` in its local output folder (JobError for a store URI: ``results``)."""
    output, key = _results(job_id, jobs)
    if output.local_root is None:
        raise JobError(f"job {job_id} put its results in the store at {output.uri}: read them with results()")
    return output.local_root / key


def results(job_id: str, jobs=None) -> bytes:
    """A finished job's ``results.jsonl``, from a local folder or a store."""
    output, key = _results(job_id, jobs)
    return output.get(key)


def dumps(report: dict) -> str:
    return json.dumps(report, indent=1, default=str)
