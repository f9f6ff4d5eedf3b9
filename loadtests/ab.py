"""``foreserve loadtest ab``: the same load (same prompts, same Poisson arrival times) against the
online pool's scheduler ``online`` and ``fcfs`` back to back, at one or more rates; and
``foreserve loadtest stub-check``: the load generator alone against a stub endpoint.

Each scheduler gets a fresh service (serve_config.yaml with only ``pools.online.scheduler`` changed,
the online pool given the test's SLOs, autoscaling off);
with ``repeats`` > 1 the order alternates and medians are reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from app.ports import free_port
from loadtests.loadtest import ROOT, LoadSpec, Service, _measure, build_workload, get_json, served_model
from loadtests.summary import SLO, key_figures, medians


def scheduler_config(source: Path, out: Path, scheduler: str | None, slo: SLO | None = None,
                     fixed_replicas: bool = False, dtype: str | None = None, online: dict | None = None) -> Path:
    """``source`` with the online pool's scheduler set and, with ``slo``, its TTFT/TPOT objectives (the
    scheduler aims at the SLOs the test measures); with ``fixed_replicas`` autoscaling is off and each
    pool keeps its initial replicas (an A/B of schedulers should not also be one of scaling); with
    ``dtype``, every pool's weights dtype; ``online``: more fields of the online pool."""
    data = yaml.safe_load(source.read_text())
    entry = data["applications"][0]
    if scheduler:
        entry["args"]["pools"]["online"]["scheduler"] = scheduler
    if dtype:
        for pool in entry["args"]["pools"].values():
            pool["dtype"] = dtype
    if slo is not None:
        entry["args"]["pools"]["online"].update(ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms)
    entry["args"]["pools"]["online"].update(online or {})
    if fixed_replicas:
        entry.pop("autoscaling_policy", None)
        for d in entry.get("deployments", []):
            scaling = d.pop("autoscaling_config", None)
            if scaling:
                d["num_replicas"] = max(1, scaling.get("initial_replicas") or scaling.get("min_replicas") or 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def warm_up(url: str) -> None:
    """One short request per tier: the first forward passes of a fresh replica are slow."""
    import httpx

    model = served_model(url)
    for tier in ("default", "flex"):
        body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "service_tier": tier}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def wait_idle(url: str, timeout_s: float = 300) -> None:
    """Until no pool has requests running or waiting (the last load's stragglers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pools = (get_json(f"{url}/health") or {}).get("pools") or {}
        if pools and all(not p.get("num_running") and not p.get("num_waiting") for p in pools.values()):
            return
        time.sleep(1)


def _preemptions(url: str) -> tuple[int, int]:
    """The online pool's preemptions and recomputed tokens so far (its engine's counters)."""
    pool = ((get_json(f"{url}/health") or {}).get("pools") or {}).get("online") or {}
    return int(pool.get("preemptions") or 0), int(pool.get("recomputed_tokens") or 0)


def run_ab(spec: LoadSpec, rates: list[float], duration_s: float, report: Path, config: Path,
           schedulers: tuple[str, ...] = ("online", "fcfs"), repeats: int = 1) -> dict:
    runs: dict[str, dict[float, list[dict]]] = {s: {r: [] for r in rates} for s in schedulers}
    for rep in range(repeats):
        order = schedulers if rep % 2 == 0 else tuple(reversed(schedulers))
        for scheduler in order:
            out = report / f"{scheduler}"
            cfg = scheduler_config(config, out / "serve_config.yaml", scheduler, spec.slos["online"], fixed_replicas=True)
            service = Service(cfg, out / f"service_{rep}.log")
            try:
                warm_up(service.url)
                for rate in rates:
                    wait_idle(service.url)
                    run_spec = spec.model_copy(update={"stages": f"steady:{duration_s:g}:{rate:g}"})
                    run_dir = out / f"rate_{rate:g}" / f"run_{rep}"
                    run_dir.mkdir(parents=True, exist_ok=True)
                    workload = run_dir / "workload.jsonl"
                    build_workload(run_spec, workload)
                    before = _preemptions(service.url)
                    summary = _measure(run_spec, service.url, run_dir, workload,
                                       {"scheduler": scheduler, "repeat": rep, "startup_s": round(service.startup_s, 1)}, True)
                    after = _preemptions(service.url)
                    runs[scheduler][rate].append({**key_figures(summary), "preemptions": after[0] - before[0],
                                                  "recomputed_tokens": after[1] - before[1]})
                    print(f"{scheduler:>6} rate {rate:g}: {json.dumps(runs[scheduler][rate][-1])}", flush=True)
            finally:
                service.stop()
    result = {"schedulers": list(schedulers), "rates": rates, "duration_s": duration_s, "repeats": repeats,
              "slo": {t: s.model_dump() for t, s in spec.slos.items()}, "max_tokens": spec.max_tokens,
              "runs": {s: {f"{r:g}": v for r, v in by_rate.items()} for s, by_rate in runs.items()}, "by_rate": []}
    a, b = schedulers
    for rate in rates:
        med = {s: medians(runs[s][rate]) for s in schedulers}
        result["by_rate"].append({
            "rate": rate, **{s: med[s] for s in schedulers},
            "mean_e2e_ratio": _ratio(med[b]["mean_e2e_ms"], med[a]["mean_e2e_ms"]),  # > 1: a is faster
            "goodput_ratio": _ratio(med[a]["goodput_rps"], med[b]["goodput_rps"]),
        })
    (report / "ab.json").write_text(json.dumps(result, indent=2))
    plot_ab(result, report / "ab.png")
    return result


def _ratio(x: float | None, y: float | None) -> float | None:
    if x is None or y is None:
        return None
    return round(x / y, 3) if y else float("inf") if x else None


def plot_ab(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    rates = [row["rate"] for row in result["by_rate"]]
    for scheduler in result["schedulers"]:
        for ax, key, label in zip(axes, ("mean_e2e_ms", "goodput_rps", "ttft_p90_ms"),
                                  ("mean E2E latency (ms)", "goodput (req/s within SLO)", "p90 TTFT (ms)")):
            ax.plot(rates, [row[scheduler][key] for row in result["by_rate"]], marker="o", label=scheduler)
            ax.set(xlabel="offered rate (req/s)", ylabel=label)
    axes[2].axhline(result["slo"]["online"]["ttft_ms"], color="grey", linestyle="--", label="TTFT SLO")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("online scheduler A/B (same prompts, same arrivals)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_stub_check(spec: LoadSpec, report: Path, ttft_ms: float = 50, itl_ms: float = 20) -> dict:
    """The load at ``spec``'s rate against loadtests/stub_server.py: is every arrival sent on time?"""
    report.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (report / "stub.log").open("w")
    stub = subprocess.Popen([sys.executable, "-m", "loadtests.stub_server", "--port", str(port), "--ttft-ms", str(ttft_ms),
                             "--itl-ms", str(itl_ms)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while get_json(f"{url}/health", 2) is None:
            if stub.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stub server did not start; see {report / 'stub.log'}")
            time.sleep(0.2)
        workload = report / "workload.jsonl"
        build_workload(spec, workload)
        summary = _measure(spec, url, report, workload, {"stub": {"ttft_ms": ttft_ms, "itl_ms": itl_ms}}, False)
    finally:
        stub.terminate()
        stub.wait(10)
        log.close()
    from loadtests.summary import read_records

    records = read_records(report / "requests.jsonl")
    lags = sorted(r.get("lag_ms", 0) for r in records)
    window = summary["config"]["arrival_window_s"]
    online = summary["tiers"]["online"]
    check = {
        "target_rps": summary["rate"], "sent_rps": round(len(records) / window, 3),
        "requests": len(records), "failures": sum(t["failures"] for t in summary["tiers"].values()),
        "p99_send_lag_ms": lags[int(0.99 * (len(lags) - 1))] if lags else None,
        "ttft_overhead_p50_ms": round(online["ttft_ms"]["p50"] - ttft_ms, 2) if online["ttft_ms"]["p50"] else None,
        "itl_p50_ms": online["itl_ms"]["p50"], "stub_itl_ms": itl_ms,
        "chunks_per_s": round(sum(len(r.get("itl_ms") or []) + 1 for r in records) / summary["duration_s"], 1),
    }
    (report / "stub_check.json").write_text(json.dumps(check, indent=2))
    return check
