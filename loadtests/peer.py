"""``foreserve loadtest peer``: the same online load against foreserve and llama.cpp's ``llama-server``
on the same machine, back to back, at each rate; medians of repeats, the order alternating.

llama-server runs the served weights as a GGUF (``loadtests/bench/llama_cpp.py``) with one unified
KV cache and a fixed number of slots, and starts afresh for every run (it has no /health that says
it is idle). foreserve runs the given serve_config.yaml, its online pool aimed at the test's SLOs,
optionally with a step policy per variant (``--tpot-targets default,knee,slowdown:3,100``: the
config's, the throughput knee, steps within three one-token steps, and steps sized for 100 ms) and a
``torch_threads`` (``--online-threads 1,2``: every target at each count). One service per variant
and repeat serves every rate.

Requests a system refuses (foreserve's 429 + ``Retry-After`` when its online queue passes
``max_queue_delay_ms``) count as failures: they lower SLO attainment and goodput, and they are not in
the latency percentiles, which describe the answered requests. Goodput here is the requests within
the SLOs per second of the arrival window (``good_per_window_rps``), the same denominator for every
system: a load test's own ``goodput_rps`` divides by the time to the last answer, which a system
with a long queue stretches and one that refuses early shortens. ``peer.json`` holds every run and
is written again after each system's runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.ab import _ratio, scheduler_config, wait_idle, warm_up
from loadtests.loadtest import LoadSpec, Service, run_load
from loadtests.summary import key_figures, medians

LLAMA = "llama-server"
# The online targets, foreserve against llama-server: (metric, better when, factor)
TARGETS = (("tpot_p50_ms", "lower", 1.0), ("mean_e2e_ms", "lower", 1.0), ("good_per_window_rps", "higher", 1.5),
           ("ttft_p90_ms", "lower", 1.0))


# (a step policy, ``step_policy``'s spec; the online pool's torch_threads, or None: the config's)
Variant = tuple[str, int | None]

STEP_POLICIES = "`default`, `knee`, `knee:FRACTION`, `slowdown:K` or a step time in ms"


def _positive(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def step_policy(spec: str) -> tuple[str, dict]:
    """A ``--tpot-targets`` entry -> (its name in the tables, the online pool's fields it sets):
    ``default`` (the config's step policy), ``knee`` / ``knee:F`` (the throughput knee, at F of the
    best throughput), ``slowdown:K`` (steps within K one-token steps) or a number (``tpot_target_ms``).
    Raises ValueError for anything else."""
    kind, _, arg = spec.partition(":")
    if spec == "default":
        return "foreserve", {}
    if spec == "knee":
        return "foreserve knee", {"tpot_slowdown": None}
    if kind == "knee" and arg:
        fraction = _positive(arg)
        if fraction is None or fraction > 1:
            raise ValueError(f"--tpot-targets: {spec!r}: a knee's throughput fraction is above 0 and at most 1")
        return f"foreserve knee {arg}", {"tpot_slowdown": None, "knee_throughput_fraction": fraction}
    if kind == "slowdown" and arg:
        factor = _positive(arg)
        if factor is None or factor < 1:
            raise ValueError(f"--tpot-targets: {spec!r}: a slowdown is at least 1")
        return f"foreserve slowdown {arg}", {"tpot_slowdown": factor}
    if not arg and _positive(spec) is not None:
        return f"foreserve tpot {spec} ms", {"tpot_target_ms": float(spec)}
    raise ValueError(f"--tpot-targets: {spec!r} is none of {STEP_POLICIES}")


def variant_name(tpot_target: str, threads: int | None = None) -> str:
    name = step_policy(tpot_target)[0]
    return name if threads is None else f"{name} {threads} thread{'s' if threads > 1 else ''}"


def variant_config(source: Path, out: Path, tpot_target: str, spec: LoadSpec, threads: int | None = None) -> Path:
    """``source`` with the online pool aimed at the test's SLOs, the step policy ``tpot_target``
    names (``step_policy``) and, with ``threads``, its ``torch_threads``."""
    online = dict(step_policy(tpot_target)[1])
    if threads is not None:
        online["torch_threads"] = threads
    return scheduler_config(source, out, None, spec.slos["online"], online=online)


def verdicts(ours: dict, peer: dict) -> list[dict]:
    """Each target: foreserve's and the peer's medians, the ratio, and whether it holds."""
    rows = []
    for metric, better, factor in TARGETS:
        a, b = ours.get(metric), peer.get(metric)
        if a is None or b is None:
            rows.append({"metric": metric, "foreserve": a, "peer": b, "ratio": None, "met": False})
            continue
        ratio = _ratio(a, b)  # the peer at 0: inf where foreserve is above it, None where both are 0
        met = a <= b * factor if better == "lower" else (a >= b * factor and a > 0)
        rows.append({"metric": metric, "foreserve": a, "peer": b, "ratio": ratio, "met": met,
                     "target": f"{'<=' if better == 'lower' else '>='} {factor:g}x"})
    return rows


def _run(spec: LoadSpec, url: str, out: Path, rate: float, duration_s: float, extra: dict) -> dict:
    run_spec = spec.model_copy(update={"stages": f"steady:{duration_s:g}:{rate:g}"})
    return key_figures(run_load(run_spec, out, url, None, extra))  # a fresh records file, even in a report dir used before


def _llama_runs(spec, rates, duration_s, report, rep, llama: dict) -> dict[float, dict]:
    from loadtests.bench.llama_cpp import LlamaServer, gguf

    got = {}
    for rate in rates:
        with LlamaServer(gguf(llama["dtype"]), llama["ctx_tokens"], llama["slots"], llama["threads"]) as server:
            warm_up(server.url)
            got[rate] = _run(spec, server.url, report / "llama-server" / f"rate_{rate:g}" / f"run_{rep}", rate, duration_s,
                             {"system": LLAMA, "repeat": rep, **llama})
    return got


def _foreserve_runs(spec, rates, duration_s, report, rep, config: Path, variant: Variant) -> dict[float, dict]:
    name = variant_name(*variant)
    out = report / name.replace(" ", "_")
    service = Service(variant_config(config, out / "serve_config.yaml", variant[0], spec, variant[1]), out / f"service_{rep}.log")
    got = {}
    try:
        warm_up(service.url)
        for rate in rates:
            wait_idle(service.url)
            got[rate] = _run(spec, service.url, out / f"rate_{rate:g}" / f"run_{rep}", rate, duration_s,
                             {"system": name, "repeat": rep, "startup_s": round(service.startup_s, 1)})
    finally:
        service.stop()
    return got


def run_peer(spec: LoadSpec, rates: list[float], duration_s: float, report: Path, config: Path,
             variants: list[Variant], llama: dict, repeats: int = 1) -> dict:
    """Every system at every rate, ``repeats`` times (the order reversed on odd repeats); writes
    peer.json after each system's runs (a sweep cut short keeps what it measured) and returns it."""
    systems = [LLAMA] + [variant_name(*v) for v in variants]
    runs: dict[str, dict[float, list[dict]]] = {s: {r: [] for r in rates} for s in systems}
    meta = {"systems": systems, "rates": rates, "duration_s": duration_s, "repeats": repeats, "llama_server": llama,
            "slo": {t: s.model_dump() for t, s in spec.slos.items()}, "max_tokens": spec.max_tokens}
    report.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    for rep in range(repeats):
        order = [None, *variants]
        for variant in (order if rep % 2 == 0 else order[::-1]):
            got = (_llama_runs(spec, rates, duration_s, report, rep, llama) if variant is None
                   else _foreserve_runs(spec, rates, duration_s, report, rep, config, variant))
            name = LLAMA if variant is None else variant_name(*variant)
            for rate, figures in got.items():
                runs[name][rate].append(figures)
                print(f"{name} rate {rate:g} run {rep}: {json.dumps(figures)}", flush=True)
            result = summarize_runs(runs, meta)
            (report / "peer.json").write_text(json.dumps(result, indent=2))
    plot_peer(result, report / "peer.png")
    return result


def summarize_runs(runs: dict[str, dict[float, list[dict]]], meta: dict) -> dict:
    """peer.json: ``meta``, every run, and per rate each system's medians and the targets against
    llama-server (a system or rate not run yet is left out)."""
    by_rate = []
    for rate in meta["rates"]:
        med = {s: medians(by[rate]) for s, by in runs.items() if by[rate]}
        targets = {s: verdicts(m, med[LLAMA]) for s, m in med.items() if s != LLAMA and LLAMA in med}
        by_rate.append({"rate": rate, "medians": med, "targets": targets})
    return {**meta, "runs": {s: {f"{r:g}": v for r, v in by.items()} for s, by in runs.items()}, "by_rate": by_rate}


def plot_peer(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("tpot_p50_ms", "TPOT p50 (ms)"), ("mean_e2e_ms", "mean E2E (ms)"),
              ("good_per_window_rps", "goodput (req/s within SLO, per s of arrivals)"),
              ("ttft_p90_ms", "TTFT p90 (ms, log)"), ("failed_share", "refused or failed (share of sent)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(22, 4))
    for system in result["systems"]:
        rows = [row for row in result["by_rate"] if system in row["medians"]]
        rates = [row["rate"] for row in rows]
        for ax, (key, label) in zip(axes, panels):
            meds = [row["medians"][system] for row in rows]
            ys = [m["failures"] / m["requests"] if key == "failed_share" and m["requests"] else m.get(key) for m in meds]
            ax.plot(rates, [float("nan") if y is None else y for y in ys], marker="o", label=system)
            ax.set(xlabel="offered rate (req/s)", ylabel=label)
    axes[0].axhline(result["slo"]["online"]["tpot_ms"], color="grey", linestyle="--", label="TPOT SLO")
    axes[3].axhline(result["slo"]["online"]["ttft_ms"], color="grey", linestyle="--", label="TTFT SLO")
    axes[3].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"online load, foreserve and llama-server (medians of {result['repeats']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
