"""What the multinode tests that run foreserve's app on the cluster share: deploying it from a config
file as ``foreserve serve`` does (Serve's declarative API, the proxy on the head), a chat, and a
bounded wait."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from app.ports import free_port

MODEL = "SmolLM2-135M-Instruct"


def deploy(config: Path, env: dict[str, str]) -> tuple[str, str]:
    """Deploy the app of ``config`` on the connected cluster, the replicas given ``env``, behind a
    proxy on the head at a free port of 127.0.0.1; returns its URL (not waited for) and its name."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from deployments.launch import application_schema

    http = {"host": "127.0.0.1", "port": free_port()}
    serve.start(proxy_location="HeadOnly", http_options=http)
    entry = application_schema(config, env)
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(
        {"proxy_location": "HeadOnly", "http_options": http, "applications": [entry]}))
    return f"http://127.0.0.1:{http['port']}", entry["name"]


def chat(url: str, max_tokens: int = 8, timeout_s: float = 60) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)


def wait_for(check, timeout_s: float, what: str):
    """``check()``'s first truthy result, polled every second; an AssertionError naming ``what`` and the
    last error (no route, no JSON, no pool yet) if none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout_s:.0f} s (last error: {last})")
