"""The elasticity scenario on the real app: an online burst makes the offline pool give up its
replica, and it comes back once online is calm; every request of the burst is answered.

Starts the app (``foreserve serve``'s code path, so the application-level ``ElasticPolicy`` runs in
Serve's controller) on a free port, waits for the offline replica, then sends ``burst_requests``
online chat requests at once (plus ``flex_requests`` to the offline pool) and watches the offline
pool's replicas with ``serve.status()``. Once the pool has given its replica up, ``late_flex_requests``
more flex requests arrive: they must wait at the ingress, not wake the pool while online is still
busy (Serve's cold-start rule would). Reports when the offline pool reached 0 and when it was back,
counted from the burst's start and end, whether anything woke it in between, and the policy's
decisions with their reasons.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

PROMPTS = [f"Tell me a story about a {animal} who learns to {skill}." for animal, skill in
           [("fox", "swim"), ("owl", "cook"), ("cat", "sing"), ("bear", "paint"), ("crow", "count"), ("frog", "fly"),
            ("dog", "read"), ("mole", "dance"), ("goat", "knit"), ("hare", "sail"), ("wolf", "sew"), ("duck", "ski")]]


def burst_config(source: Path, out: Path, ttft_slo_ms: float = 1000, calm_s: float = 5) -> Path:
    """serve_config.yaml with a tight online TTFT SLO (so a small burst is pressure) and a short calm.
    Nothing is shed (``max_queue_delay_ms``): the whole burst is the backlog the autoscaler must
    see, and every request of it is counted (shedding is ``foreserve chaos``'s overload scenario)."""
    data = yaml.safe_load(source.read_text())
    entry = data["applications"][0]
    entry["args"]["pools"]["online"].update(ttft_slo_ms=ttft_slo_ms, max_queue_delay_ms=None)
    entry["autoscaling_policy"]["policy_kwargs"].update(calm_s=calm_s)
    out.write_text(yaml.safe_dump(data))
    return out


def pool_replicas(app_name: str, pool: str, states: tuple[str, ...] = ("RUNNING",)) -> int:
    """Replicas of ``pool`` in any of ``states`` (0 when the app or pool is not deployed)."""
    from deployments.pool_gate import replica_states

    counts = replica_states(app_name, [pool])[pool]
    return sum(counts.get(state, 0) for state in states)


def _watch(app_name: str, pool: str, samples: list, stop: threading.Event, poll_s: float = 0.5) -> None:
    """(monotonic time, replicas running or starting) of ``pool`` until ``stop``."""
    while not stop.is_set():
        samples.append((time.monotonic(), pool_replicas(app_name, pool, ("RUNNING", "STARTING"))))
        stop.wait(poll_s)


def wait_until(predicate, timeout_s: float, poll_s: float = 0.5) -> float | None:
    """Seconds until ``predicate()`` held, or None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None


def send_chat(url: str, model: str, prompt: str, tier: str, max_tokens: int, results: list, key: str | None = None) -> None:
    """One greedy chat of ``max_tokens`` on ``tier``; appends its status, tokens and seconds (or the
    exception, a lost request) to ``results``."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "service_tier": tier}
    headers = {"Authorization": f"Bearer {key}"} if key else None
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
        tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
        results.append({"tier": tier, "status": r.status_code, "tokens": tokens, "s": time.monotonic() - t0})
    except Exception as exc:  # noqa: BLE001 - a lost request is the failure this scenario looks for
        results.append({"tier": tier, "status": None, "error": repr(exc), "s": time.monotonic() - t0})


def run(burst_requests: int = 16, flex_requests: int = 2, max_tokens: int = 64, config: str | None = None,
        ttft_slo_ms: float = 1000, calm_s: float = 5, timeout_s: float = 180, work_dir: str | None = None,
        late_flex_requests: int = 2) -> dict:
    """The scenario; returns timings, request outcomes and the decision log entries it caused."""
    import tempfile

    from app.config import APP_NAME, DEFAULT_CONFIG_PATH
    from autoscale.decisions import default_log_path, read_decisions
    from app.ports import free_port
    from deployments.launch import start, stop

    work = Path(work_dir or tempfile.mkdtemp(prefix="foreserve-burst-"))
    cfg = burst_config(Path(config) if config else DEFAULT_CONFIG_PATH, work / "serve_config.yaml", ttft_slo_ms, calm_s)
    port = free_port()
    log_path = default_log_path()
    logged_before = len(read_decisions(log_path))
    url, startup_s, app_config = start(str(cfg), port=port)
    samples: list[tuple[float, int]] = []
    stop_watch = threading.Event()
    try:
        model = app_config.pools["online"].model_id
        offline_up_s = wait_until(lambda: pool_replicas(APP_NAME, "offline") >= 1, 120)
        if offline_up_s is None:
            raise RuntimeError("the offline pool never started its replica")
        results: list[dict] = []

        def senders(n: int, tier: str, tokens: int) -> list[threading.Thread]:
            return [threading.Thread(target=send_chat, args=(url, model, PROMPTS[i % len(PROMPTS)], tier, tokens, results))
                    for i in range(n)]

        online, flex = senders(burst_requests, "default", max_tokens), senders(flex_requests, "flex", max_tokens // 2)
        late = senders(late_flex_requests, "flex", max_tokens // 2)
        watcher = threading.Thread(target=_watch, args=(APP_NAME, "offline", samples, stop_watch), daemon=True)
        burst_start, burst_wall = time.monotonic(), time.time()
        watcher.start()
        for t in online + flex:
            t.start()
        gave_up_s = wait_until(lambda: pool_replicas(APP_NAME, "offline", ("RUNNING", "STARTING")) == 0, timeout_s)
        gave_up_at = time.monotonic()
        for t in late:  # the pool has yielded and online is still busy: these must not wake it
            t.start()
        for t in online:
            t.join()
        burst_s = time.monotonic() - burst_start
        online_done_at = time.monotonic()
        back_s = wait_until(lambda: pool_replicas(APP_NAME, "offline") >= 1, timeout_s)
        for t in flex + late:
            t.join()
        stop_watch.set()
        decisions = read_decisions(log_path)[logged_before:]
    finally:
        stop_watch.set()
        stop()
    woken = [round(t - burst_start, 1) for t, up in samples if gave_up_s is not None and gave_up_at < t < online_done_at and up]
    return {
        "startup_s": round(startup_s, 1),
        "burst_requests": burst_requests,
        "flex_requests": flex_requests,
        "late_flex_requests": late_flex_requests,
        "burst_s": round(burst_s, 1),
        "offline_gave_up_after_s": None if gave_up_s is None else round(gave_up_s, 1),
        "offline_back_after_burst_s": None if back_s is None else round(back_s, 1),
        # seconds (since the burst started) at which the yielded pool had a replica up while online was still busy
        "offline_woken_during_burst_s": woken,
        "answered": sum(1 for r in results if r["status"] == 200),
        "failed": [r for r in results if r["status"] != 200],
        "output_tokens": sum(r.get("tokens", 0) for r in results),
        # t_s: seconds since the burst started (negative: before it)
        "decisions": [{"t_s": round(d["time"] - burst_wall, 1), **{k: d[k] for k in ("pool", "current", "desired", "reason", "detail")}}
                      for d in decisions],
    }
