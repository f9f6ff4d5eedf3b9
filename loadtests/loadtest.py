"""``foreserve loadtest``: Locust, headless, as its own process, against a running service or one it
starts; then summary.json, Locust's CSVs and HTML, and report.html with plots in the report dir.

This module never imports ray, mlflow or locust: Locust runs in a subprocess (gevent breaks after
ray or mlflow in one process), the service in another (``foreserve serve`` on a free port).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from deployments.health import is_serving
from app.ports import free_port
from loadtests.shapes import Tokenizer, parse_shape, shaped_items
from loadtests.stages import Stages, parse_stages
from loadtests.summary import SLO, read_records, summarize

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"


class LoadSpec(BaseModel):
    """One load test: what to send and what counts as good."""

    stages: str = Field(description="name:seconds:level[,...] (level = rps open loop, users closed loop)")
    mode: str = Field("open", pattern="^(open|closed)$")
    tier_mix: dict[str, float] = Field(default_factory=lambda: {"online": 1.0, "flex": 0.0})
    max_tokens: int = Field(256, ge=1, description="cap on each request's true ShareGPT length")
    slos: dict[str, SLO]
    seed: int = 0
    drain_s: float = Field(120, ge=0)
    think_s: float = Field(0, ge=0)
    ignore_eos: bool = True
    cancel_fraction: float = Field(0.0, ge=0, le=1, description="this share of requests is cancelled by the client mid-answer")
    shapes: list[str] = Field(default_factory=list, description="PROMPT_TOKENS:OUTPUT_TOKENS shapes, mixed uniformly, "
                              "instead of ShareGPT's prompts and lengths (loadtests/shapes.py)")
    arrivals: str = Field("poisson", pattern="^(poisson|constant)$", description="open loop: Poisson arrivals at the "
                          "rate, or one every 1/rate seconds")
    tokenizer: str | None = Field(None, description="HF folder whose tokenizer counts a shape's prompt tokens "
                                  "(default: the embedded model's)")

    @field_validator("shapes")
    @classmethod
    def _shapes(cls, shapes: list[str]) -> list[str]:
        return [str(parse_shape(s)) for s in shapes]

    def parsed_stages(self) -> Stages:
        return parse_stages(self.stages)


SHAPE_CORPUS_PROMPTS = 3000  # ShareGPT prompts a shaped workload cuts its prompts from (~300k tokens)


def build_workload(spec: LoadSpec, path: Path, split: str = "validation") -> int:
    """Validation-split prompts in a seeded order, max_tokens = true length capped at ``spec.max_tokens``
    (or, with ``spec.shapes``, prompts of exactly the shapes' tokens: ``loadtests.shapes``), tiers
    drawn from the mix; as many as the stages can use (the locustfile cycles if it needs more)."""
    from app.prepare.traces import load_trace

    rng = random.Random(spec.seed)
    # NOTE: ShareGPT has turns whose user text is blank; the API rightly answers them 400, which
    # would count as a failure of the service under test
    records = [r for r in load_trace(split) if r.user.strip()]
    rng.shuffle(records)
    stages = spec.parsed_stages()
    wanted = int(stages.mean_level() * stages.total_s * 1.5) + 50 if spec.mode == "open" else 2000
    tiers, weights = zip(*spec.tier_mix.items())
    if spec.shapes:
        from app import paths

        tokenizer = Tokenizer.from_pretrained(spec.tokenizer or str(paths.model_dir()))
        items = shaped_items([parse_shape(s) for s in spec.shapes], wanted, [r.user for r in records[:SHAPE_CORPUS_PROMPTS]],
                             tokenizer, spec.seed, lambda r: r.choices(tiers, weights)[0])
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
        return len(items)
    lines = []
    for i in range(min(wanted, len(records))):
        r = records[i]
        tier = rng.choices(tiers, weights)[0]
        item = {"prompt": r.user, "max_tokens": min(r.output_tokens, spec.max_tokens), "tier": tier}
        if spec.cancel_fraction and rng.random() < spec.cancel_fraction:  # NOTE: no draw without: same workloads
            item["cancel_after"] = rng.randint(1, max(1, item["max_tokens"] // 2))  # content chunks, then walk away
        lines.append(json.dumps(item))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def get_json(url: str, timeout_s: float = 10) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


class Service:
    """``foreserve serve`` in its own process group on a free port; ``stop()`` takes it all down."""

    def __init__(self, config: Path | None, log_path: Path, timeout_s: float = 300, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "foreserve.cli.main", "serve", "--port", str(self.port), "--no-prepare"]
        if config:
            cmd += ["--config", str(config)]
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **(env or {})}
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        while not is_serving(get_json(f"{self.url}/health", 5)):
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                self.stop()
                tail = log_path.read_text()[-2000:]
                raise RuntimeError(f"the service did not come up (see {log_path}):\n{tail}")
            time.sleep(1)
        self.startup_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the local Ray cluster is left
        except ProcessLookupError:
            pass
        self.log.close()


class HealthPoller(threading.Thread):
    """``GET /health`` every ``every_s``: replicas per pool and their running/waiting requests, for the plots."""

    def __init__(self, url: str, path: Path, every_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.every_s = url, path, every_s
        self.stopped = threading.Event()

    def run(self) -> None:
        with self.path.open("a") as out:
            while not self.stopped.is_set():
                health = get_json(f"{self.url}/health", 10)
                if health is not None:
                    out.write(json.dumps({"t": time.time(), "replicas": health.get("replicas"),
                                          "pools": health.get("pools")}) + "\n")
                    out.flush()
                self.stopped.wait(self.every_s)

    def stop(self) -> None:
        self.stopped.set()
        self.join(15)


def served_model(url: str) -> str:
    """The model id the service answers to (its /health), which the requests must name."""
    health = get_json(f"{url}/health") or {}
    return health.get("model") or ""


def run_locust(spec: LoadSpec, host: str, report: Path, workload: Path, api_key: str = "") -> int:
    """Locust, headless, as a subprocess; its CSVs and HTML go to ``report``; returns its exit code."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
           "--csv", str(report / "locust"), "--csv-full-history", "--html", str(report / "locust.html"),
           "--only-summary", "--loglevel", "WARNING", "--exit-code-on-error", "0",
           "--stop-timeout", str(math.ceil(spec.drain_s)),  # closed loop: users finish the request they are in
           "--fs-workload", str(workload), "--fs-stages", spec.stages, "--fs-mode", spec.mode,
           "--fs-records", str(report / "requests.jsonl"), "--fs-seed", str(spec.seed),
           "--fs-drain-s", str(spec.drain_s), "--fs-think-s", str(spec.think_s),
           "--fs-ignore-eos", "true" if spec.ignore_eos else "false", "--fs-model", served_model(host),
           "--fs-arrivals", spec.arrivals]
    if api_key:
        cmd += ["--fs-api-key", api_key]
    with (report / "locust.log").open("w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def run_load(spec: LoadSpec, report: Path, host: str | None = None, config: Path | None = None,
             extra: dict | None = None, plots: bool = True) -> dict:
    """One load test against ``host`` (or a service started from ``config`` and stopped after);
    returns summary.json's content."""
    report.mkdir(parents=True, exist_ok=True)
    for name in ("requests.jsonl", "health.jsonl"):
        (report / name).unlink(missing_ok=True)
    workload = report / "workload.jsonl"
    build_workload(spec, workload)
    service = None if host else Service(config, report / "service.log")
    url = host or service.url
    try:
        return _measure(spec, url, report, workload, {**(extra or {}), **({"startup_s": round(service.startup_s, 1)}
                                                                         if service else {})}, plots)
    finally:
        if service:
            service.stop()


def _measure(spec: LoadSpec, url: str, report: Path, workload: Path, extra: dict, plots: bool) -> dict:
    poller = HealthPoller(url, report / "health.jsonl")
    poller.start()
    try:
        code = run_locust(spec, url, report, workload, os.environ.get("FORESERVE_API_KEY", ""))
    finally:
        poller.stop()
    records = read_records(report / "requests.jsonl")
    if not records:
        raise RuntimeError(f"Locust sent no request (exit {code}); see {report / 'locust.log'}")
    stages = spec.parsed_stages()
    config = {"host": url, "mode": spec.mode, "stages": spec.stages, "tier_mix": spec.tier_mix,
              "max_tokens": spec.max_tokens, "seed": spec.seed, "ignore_eos": spec.ignore_eos,
              "shapes": spec.shapes or None, "arrivals": spec.arrivals,
              "rate": round(stages.mean_level(), 4) if spec.mode == "open" else None,
              "arrival_window_s": stages.total_s, "locust_exit_code": code, **extra}
    summary = summarize(records, spec.slos, config)
    errors = [r["error"] for r in records if r.get("error")]
    if errors:
        print(f"warning: {len(errors)} of {len(records)} requests failed; the first: {errors[0][:300]}", flush=True)
    (report / "summary.json").write_text(json.dumps(summary, indent=2))
    if plots:
        from loadtests.loadtest_report import write_report

        write_report(report, summary, records)
    return summary
