"""What serving adds on top of the engine: startup time, TTFT through HTTP vs in the engine, and
whether tokens stream as they are generated.

Starts the app (``foreserve serve``'s code path) on a free port, then sends one streaming request
at a time. For each, the online engine replica reports the wall-clock times at which it received
the request and emitted each item (same machine, same clock), so per request:
- ``overhead_ms`` = client TTFT − engine TTFT (ingress, predictor call, Ray hops, HTTP);
- ``delivery_lag_ms`` = client receipt of the last chunk − engine emission of the last item;
- ``spread_ratio`` = (last − first content chunk at the client) / (last − first item at the engine):
  1.0 means each token reached the client as it was generated; a buffering server gives ≈ 0.
"""

from __future__ import annotations

import json
import statistics
import time

PROMPT = "Write a short poem about the sea."


def _stats(values: list[float]) -> dict:
    values = sorted(values)
    return {"p50": round(statistics.median(values), 2), "p90": round(values[int(0.9 * (len(values) - 1))], 2),
            "mean": round(statistics.fmean(values), 2)}


def _one(client, url: str, model: str, max_tokens: int) -> tuple[str, float, list[float]]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    sent = time.time()
    arrivals = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        request_id = r.headers["x-foreserve-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and (chunk["choices"][0]["delta"].get("content") or chunk["choices"][0].get("finish_reason")):
                    arrivals.append(time.time())
    return request_id, sent, arrivals


def run(requests: int = 20, max_tokens: int = 32, config: str | None = None) -> dict:
    from ray import serve

    from app.ports import free_port
    from deployments.launch import start, stop

    port = free_port()
    t0 = time.perf_counter()
    url, deploy_s, app_config = start(config, port=port)
    model = app_config.pools["online"].model_id
    import httpx

    client = httpx.Client(timeout=120)  # one keep-alive connection, like the openai client's pool
    try:
        _one(client, url, model, 4)
        startup_s = time.perf_counter() - t0
        online = serve.get_deployment_handle("online", "foreserve")
        rows = []
        for _ in range(requests):
            request_id, sent, arrivals = _one(client, url, model, max_tokens)
            emits = online.emit_times.remote(request_id).result()
            received, items = emits[0], emits[1:]
            rows.append({
                "http_ttft_ms": (arrivals[0] - sent) * 1000,
                "engine_ttft_ms": (items[0] - received) * 1000,
                "overhead_ms": ((arrivals[0] - sent) - (items[0] - received)) * 1000,
                "delivery_lag_ms": (arrivals[-1] - items[-1]) * 1000,
                "spread_ratio": (arrivals[-2] - arrivals[0]) / max(items[-1] - items[0], 1e-9) if len(arrivals) > 2 else 1.0,
                "output_tokens": len(items),
            })
    finally:
        client.close()
        stop()
    return {
        "config": {"requests": requests, "max_tokens": max_tokens, "prompt": PROMPT, "config": config or "serve_config.yaml"},
        "startup_s": round(startup_s, 1),
        "deploy_s": round(deploy_s, 1),
        **{key: _stats([r[key] for r in rows]) for key in ("http_ttft_ms", "engine_ttft_ms", "overhead_ms", "delivery_lag_ms", "spread_ratio")},
        "rows": rows,
    }


def print_report(report: dict) -> None:
    print(f"startup to first answer: {report['startup_s']} s (deploy {report['deploy_s']} s)")
    print(f"{'':18}{'p50':>9}{'p90':>9}{'mean':>9}")
    for key in ("http_ttft_ms", "engine_ttft_ms", "overhead_ms", "delivery_lag_ms", "spread_ratio"):
        s = report[key]
        print(f"{key:18}{s['p50']:>9}{s['p90']:>9}{s['mean']:>9}")
