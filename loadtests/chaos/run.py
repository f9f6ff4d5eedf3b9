"""``foreserve chaos``: faults injected into a live service under load, and what each one cost.

Starts the service (``foreserve serve`` on a free port, with two API keys) or takes ``--host``, then
runs each scenario in turn and writes ``summary.json`` and ``report.html``: per scenario the fault,
requests sent, answered in full, ended with a clean OpenAI-shaped error, hung (must be 0), broken (a
reset or a truncated stream without an error), seconds to the first answered request that started
after the fault, seconds until ``/health`` said ``ok`` again, and the RSS of the ingress, proxy and
replicas before and after. Load scenarios drive Locust (``loadtests/locustfile.py``, streaming, both
tiers); the others are their own clients (``loadtests/chaos/probes.py``). Faults by signal need the
service on this machine; ``forward_error`` needs the service this command starts, whose online pool
it configures with a fault folder (``app/engine/faults.py``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import yaml

from app.engine.faults import FORWARD_ERROR
from loadtests.bench.burst import wait_until
from loadtests.chaos import batch, drain, fuzz, probes, procs, redeploy, registry, scale_down, soak
from loadtests.chaos.load import FLEX_SHARE, start_load
from loadtests.chaos.score import overload, score
from loadtests.loadtest import Service, get_json, served_model
from loadtests.shapes import parse_shape
from loadtests.summary import read_records

KEYS = ("chaos-key-a", "chaos-key-b")
FAULTS = {
    "engine_kill": "SIGKILL the online engine replica with streams open",
    "forward_error": "the online engine's forward raises (an injected kernel fault) with streams open",
    "engine_freeze": "SIGSTOP the online engine replica (alive, answering nothing)",
    "predictor_kill": "SIGKILL the length predictor's replica under load",
    "predictor_freeze": "SIGSTOP the length predictor's replica under load (alive, answering nothing)",
    "controller_kill": "SIGKILL Serve's controller under load (Ray restarts it)",
    "registry_outage": "the predictor registry's MLflow server stopped under load, started again 45 s later",
    "redeploy": "the app deployed again (a changed runtime_env) under load: Serve replaces every replica",
    "overload": "arrivals at --overload-rate (ShareGPT, or --overload-shape) past what the service answers, no other fault",
    "scale_down": "flex streams open when an online burst makes the offline pool give its replica up (a drain)",
    "disconnect_storm": "streams cut by the client 0.5 s after sending, all at once",
    "fuzz": "schemathesis: requests generated from the service's OpenAPI schema, every route",
    "hostile_input": "wrong types, huge n, 10^5 messages, 1 MB header, 100 MB body, deep JSON, bad ids",
    "tenants": "key B asks for key A's file and batch: get, content, cancel, list, a batch on it",
    "batch": "a Batch API batch: its offline engine replica SIGKILLed at 1/4 of its rows, its job's driver at 1/2",
    "soak": "steady load for --soak-minutes with 5% of the answers cancelled mid-way; RSS slope per role",
    "drain": "SIGTERM to foreserve serve with streams open (ends the service: last)",
}
SIGNALS = {"engine_kill": ("online", signal.SIGKILL), "engine_freeze": ("online", signal.SIGSTOP),
           "predictor_kill": ("predictor", signal.SIGKILL), "predictor_freeze": ("predictor", signal.SIGSTOP),
           "controller_kill": ("controller", signal.SIGKILL)}
LOAD = (*SIGNALS, "forward_error", "redeploy", "registry_outage", "overload")
STARTED_ONLY = ("forward_error", "redeploy", "registry_outage", "drain")  # need the service this command started
# (its fault folder, its local cluster, its registry server, its process)


def chaos_config(config: Path | None, fault_dir: Path, out: Path) -> Path:
    """``config`` (default serve_config.yaml) with the online pool's ``fault_dir`` set, written to ``out``."""
    from app.config import DEFAULT_CONFIG_PATH, load_yaml

    top = load_yaml(config or DEFAULT_CONFIG_PATH)
    for entry in top.get("applications") or []:
        pools = (entry.setdefault("args", {}) or {}).setdefault("pools", {})
        pools.setdefault("online", {})["fault_dir"] = str(fault_dir)
    out.write_text(yaml.safe_dump(top, sort_keys=False))
    return out


def inject(name: str, fault_dir: Path | None, registry_server=None) -> list[int]:
    """Cause fault ``name`` now; the pids it hit (a file-triggered fault hits the replica reading it)."""
    if name == "overload":  # the load is the fault
        return []
    if name == "registry_outage":
        return registry.outage(registry_server)
    if name == "redeploy":
        before = procs.pids("online")
        redeploy.redeploy()
        return before
    if name == "forward_error":
        before = procs.pids("online")  # before the file: the replica that reads it may be gone within a step
        fault_dir.mkdir(parents=True, exist_ok=True)
        (fault_dir / FORWARD_ERROR).touch()
        return before
    role, sig = SIGNALS[name]
    return procs.signal_role(role, sig)


def wait_health_changed(url: str, status: str | None, timeout_s: float) -> float | None:
    """Seconds until ``/health`` no longer says ``status`` (it noticed the fault); None if not within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if probes.health_status(url) != status:
            return round(time.monotonic() - t0, 1)
        time.sleep(0.5)
    return None


def wait_health(url: str, status: str | None, timeout_s: float) -> float | None:
    """Seconds until ``/health`` says ``status`` again, the one it said before the fault (``ok``; or
    ``degraded`` on a service with no champion predictor yet); None if not within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if probes.health_status(url) == status:
            return round(time.monotonic() - t0, 1)
        time.sleep(1)
    return None


def load_scenario(name: str, url: str, out: Path, key: str, rate: float, duration_s: float, inject_s: float,
                  status: str | None, fault_dir: Path | None = None, flex_share: float = FLEX_SHARE,
                  registry_server=None, shapes: tuple[str, ...] = ()) -> dict:
    """Locust at ``rate`` for ``duration_s`` (``load.start_load``; ``shapes`` instead of ShareGPT), the fault at ``inject_s``."""
    # NOTE: under overload the flex tier (which sheds nothing: flex work waits) finishes late, not never
    locust = start_load(url, out, key, rate, duration_s, drain_s=600 if name == "overload" else 120, flex_share=flex_share,
                        shapes=shapes)
    time.sleep(inject_s)
    fallbacks = (get_json(f"{url}/health", 10) or {}).get("predictor_fallbacks")
    fault_at, t0 = time.time(), time.monotonic()
    hit = inject(name, fault_dir, registry_server)
    if name.endswith("_freeze"):  # Serve replaces it; let the frozen process go once it has
        thaw = threading.Timer(90, lambda: [_cont(p) for p in hit])
        thaw.daemon = True  # NOTE: never keeps the command alive after the run
        thaw.start()
    noticed_s = wait_health_changed(url, status, registry.NOTICE_S if name == "registry_outage" else 20)
    ok_s = wait_health(url, status, 180)
    ok_s = None if ok_s is None else round(time.monotonic() - t0, 1)  # from the fault
    locust.join()
    # NOTE: a process the fault struck must be gone (replaced, or restarted as a new one), or the fault did not happen
    wait_until(lambda: not procs.alive(hit), 120)
    records = read_records(out / "requests.jsonl")
    row = {**score(records, fault_at), **(overload(records) if name == "overload" else {})}
    after = (get_json(f"{url}/health", 10) or {}).get("predictor_fallbacks")
    return {**row, "pids_hit": hit, "pids_hit_left": procs.alive(hit), "health_noticed_s": noticed_s, "health_ok_after_s": ok_s,
            "predictor_fallbacks": None if fallbacks is None or after is None else after - fallbacks}


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def run_chaos(report: Path, scenarios: list[str], host: str | None = None, config: Path | None = None,
              rate: float = 0.5, duration_s: float = 60, inject_s: float = 15, storm_streams: int = 200,
              overload_rate: float = 6.0, fuzz_examples: int = 20, soak_minutes: float = 30.0,
              flex_share: float = FLEX_SHARE, overload_shapes: tuple[str, ...] = ()) -> dict:
    unknown = [s for s in scenarios if s not in FAULTS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; choose from {sorted(FAULTS)}")
    if host and (started := [s for s in scenarios if s in STARTED_ONLY]):
        raise ValueError(f"{started} need the service this command starts (no --host): a fault folder in its "
                         "engine's config, its local cluster, its own process")
    if "drain" in scenarios[:-1]:
        raise ValueError("drain ends the service: it must be the last scenario")
    wrong = [f"--{name} {value:g} (must be > 0)" for name, value in (("rate", rate), ("overload-rate", overload_rate),
                                                                      ("soak-minutes", soak_minutes), ("duration", duration_s))
             if value <= 0]
    wrong += [f"--{name} {value} (must be >= 1)" for name, value in (("storm-streams", storm_streams),
                                                                    ("fuzz-examples", fuzz_examples)) if value < 1]
    for shape in overload_shapes:
        try:
            parse_shape(shape)
        except ValueError as e:
            wrong.append(f"--overload-shape {e}")
    if not 0 <= flex_share <= 1:
        wrong.append(f"--flex-share {flex_share:g} (must be within 0 and 1)")
    if not 0 <= inject_s < duration_s:
        wrong.append(f"--inject-at {inject_s:g} (must be >= 0 and below --duration {duration_s:g})")
    if wrong:
        raise ValueError("need " + "; ".join(wrong))
    report.mkdir(parents=True, exist_ok=True)
    service, fault_dir, registry_server = None, report / "faults", None
    env = {"FORESERVE_API_KEYS": ",".join(KEYS)}
    if host is None and "registry_outage" in scenarios:  # the data dir's registry, behind a server to stop
        from app.paths import home

        registry_server = registry.registry_server(home(), report / "mlflow.log")
        env["MLFLOW_TRACKING_URI"] = registry_server.url
    rows = []
    try:
        if host is None:
            served = chaos_config(config, fault_dir, report / "serve_config.yaml")
            service = Service(served, report / "service.log", env=env)
        url, key = host or service.url, os.environ.get("FORESERVE_API_KEY", KEYS[0]) if host else KEYS[0]
        model = served_model(url)
        for name in scenarios:
            print(f"chaos: {name}: {FAULTS[name]}", flush=True)
            before, status, t0 = procs.memory(), probes.health_status(url), time.monotonic()
            if name in LOAD:
                row = load_scenario(name, url, report / name, key, overload_rate if name == "overload" else rate,
                                    duration_s, inject_s, status, fault_dir, flex_share, registry_server,
                                    overload_shapes if name == "overload" else ())
            elif name == "drain":
                row = drain.drain(service, url, key, model)
            elif name == "disconnect_storm":
                row = probes.disconnect_storm(url, key, model, streams=storm_streams)
            elif name == "scale_down":
                row = scale_down.scale_down(url, report / name, key, model, rate, duration_s, inject_s)
            elif name == "batch":
                row = batch.batch_faults(url, key, model)
            elif name == "soak":
                row = soak.soak(url, report / name, key, rate, soak_minutes)
            elif name == "fuzz":
                row = fuzz.fuzz(url, key, fuzz_examples)
            elif name == "hostile_input":
                row = probes.hostile_input(url, key, model)
            else:
                row = probes.tenants(url, key, os.environ.get("FORESERVE_API_KEY_B", KEYS[1]) if host else KEYS[1])
            if "health_ok_after_s" not in row:  # NOTE: not setdefault, which would ask a drained service for 180 s
                row["health_ok_after_s"] = wait_health(url, status, 180)
            row["health_before"] = status
            rows.append({"scenario": name, "fault": FAULTS[name], **row, "took_s": round(time.monotonic() - t0, 1),
                         "memory_mb_before": before, "memory_mb_after": procs.memory()})
            print(f"chaos: {name}: {_line(rows[-1])}", flush=True)
    finally:
        if service is not None:
            service.stop()
        if registry_server is not None:
            registry_server.stop()
    summary = {"host": host or "started", "rate": rate, "duration_s": duration_s, "inject_s": inject_s,
               "scenarios": rows, "hung": sum(r["hung"] for r in rows), "broken": sum(r["broken"] for r in rows)}
    (report / "summary.json").write_text(json.dumps(summary, indent=2))
    from loadtests.chaos.report import write_html

    write_html(report / "report.html", summary)
    return summary


def _line(row: dict) -> str:
    return (f"sent {row['sent']}, answered {row['answered']}, clean errors {row['clean_error']}, hung {row['hung']}, "
            f"broken {row['broken']}, recovery {row.get('recovery_s')} s, health ok after {row.get('health_ok_after_s')} s")
