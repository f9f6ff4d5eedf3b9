"""Scenarios that are their own clients: hostile input, tenants, a disconnect storm. Each returns
counts in the summary's terms (sent, answered, clean_error, broken, hung) plus what it checked."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlparse

import httpx

from loadtests.loadtest import get_json

LEAKS = ("Traceback", "site-packages", 'File "', "/work/", "/home/", "/root/", "ray.exceptions")


def _clean(response: httpx.Response) -> bool:
    """A 4xx in OpenAI's error shape that leaks no traceback, path or internals."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return 400 <= response.status_code < 500 and set(error) == {"message", "type", "param", "code"} \
        and not any(leak in response.text for leak in LEAKS)


def health_status(url: str) -> str | None:
    """``/health``'s status and the kinds of its problems (``degraded: pool online``): on a service
    already degraded (no champion yet) a fault still shows as a new problem."""
    health = get_json(f"{url}/health", 10) or {}
    kinds = sorted({p.split(": ")[0] for p in health.get("problems") or []})
    return health.get("status") if not kinds else f"{health.get('status')}: {'; '.join(kinds)}"


def hostile_requests(model: str) -> list[tuple[str, dict]]:
    """(name, httpx request kwargs) of known crashers; each must get a clean 4xx."""
    ok = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat = "/v1/chat/completions"
    post = lambda body, **kw: {"method": "POST", "url": chat, "json": body, **kw}  # noqa: E731
    return [
        ("stream as a string", post({**ok, "stream": "yes"})),
        ("max_tokens as a string", post({**ok, "max_tokens": "4"})),
        ("huge n", post({**ok, "n": 10**9})),
        ("temperature as a list", post({**ok, "temperature": [1]})),
        ("10^5 messages", post({**ok, "messages": [{"role": "user", "content": "a"}] * 100_000})),
        ("prompt past the context", post({**ok, "messages": [{"role": "user", "content": "word " * 20_000}]})),
        ("max_tokens past the context", post({**ok, "max_tokens": 10**7})),
        ("unknown model", post({**ok, "model": "not-a-model"})),
        ("deep JSON", {"method": "POST", "url": chat, "content": b"[" * 100_000,
                       "headers": {"Content-Type": "application/json"}}),
        ("not JSON", {"method": "POST", "url": chat, "content": b"\xff\xfe{",
                      "headers": {"Content-Type": "application/json"}}),
        ("a JSON list", post([1, 2, 3])),
        ("content as a number", post({**ok, "messages": [{"role": "user", "content": 5}]})),
        ("role unknown", post({**ok, "messages": [{"role": "root", "content": "hi"}]})),
        ("seed past int64", post({**ok, "seed": 2**70})),
        ("stop with 5 strings", post({**ok, "stop": ["a", "b", "c", "d", "e"]})),
        ("tools", post({**ok, "tools": [{"type": "function", "function": {"name": "f"}}]})),
        ("1 MB header", post(ok, headers={"X-Padding": "a" * (1 << 20)})),
        ("batch on a missing file", {"method": "POST", "url": "/v1/batches",
                                     "json": {"input_file_id": "file-nope", "endpoint": chat, "completion_window": "24h"}}),
        ("file id with a path", {"method": "GET", "url": "/v1/files/..%2F..%2Fetc%2Fpasswd/content"}),
        ("batches limit not a number", {"method": "GET", "url": "/v1/batches?limit=lots"}),
    ]


def declared_huge_body(url: str, key: str, declared: int = 100 * 1024 * 1024) -> tuple[int, float]:
    """Send only the headers of a POST that declares ``declared`` bytes: (status, seconds to the
    answer). A server that reads the body first never answers (timeout: status 0)."""
    parts = urlparse(url)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n{{").encode()
    t0 = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=15) as sock:
        sock.sendall(head)
        try:
            status = int(sock.recv(64).split(b" ")[1])
        except (OSError, IndexError, ValueError):
            status = 0
    return status, round(time.monotonic() - t0, 2)


def hostile_input(url: str, key: str, model: str) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    rows, clean, broken = [], 0, []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for name, kwargs in hostile_requests(model):
            kwargs = dict(kwargs)
            kwargs["headers"] = {**headers, **kwargs.get("headers", {})}
            response = client.request(**kwargs)
            ok = _clean(response)
            clean += ok
            if not ok:
                broken.append(f"{name}: HTTP {response.status_code} {response.text[:120]}")
            rows.append({"name": name, "status": response.status_code, "clean": ok})
        status, took = declared_huge_body(url, key)
        rows.append({"name": "100 MB body declared, not sent", "status": status, "clean": status == 413, "answer_s": took})
        clean += status == 413
        if status != 413:
            broken.append(f"100 MB declared body: HTTP {status} after {took} s")
        health = health_status(url)
    return {"sent": len(rows), "answered": 0, "clean_error": clean, "hung": 0, "broken": len(rows) - clean,
            "server_errors": sum(r["status"] >= 500 for r in rows), "health_after": health,
            "broken_examples": broken[:5], "requests": rows}


def tenants(url: str, key_a: str, key_b: str) -> dict:
    """Key A uploads a file and creates a batch; key B must see none of it (404, unlisted)."""
    checks: dict[str, int | bool] = {}
    a = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key_a}"}, timeout=60)
    b = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key_b}"}, timeout=60)
    with a, b:
        line = json.dumps({"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}})
        file = a.post("/v1/files", files={"file": ("t.jsonl", line + "\n")}, data={"purpose": "batch"}).json()
        batch = a.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
        batch_id = batch.json().get("id", "batch_missing") if batch.status_code == 200 else "batch_missing"
        checks["a_created"] = batch.status_code == 200
        checks["b_get_file"] = b.get(f"/v1/files/{file['id']}").status_code
        checks["b_file_content"] = b.get(f"/v1/files/{file['id']}/content").status_code
        checks["b_get_batch"] = b.get(f"/v1/batches/{batch_id}").status_code
        checks["b_cancel_batch"] = b.post(f"/v1/batches/{batch_id}/cancel").status_code
        checks["b_batch_on_a_file"] = b.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                                  "completion_window": "24h"}).status_code
        checks["b_listed"] = sum(x["id"] == batch_id for x in b.get("/v1/batches").json().get("data", []))
        checks["no_key"] = httpx.get(f"{url}/v1/batches", timeout=30).status_code
        checks["a_sees_own"] = a.get(f"/v1/batches/{batch_id}").status_code == 200
        a.post(f"/v1/batches/{batch_id}/cancel")
    denied = [k for k in ("b_get_file", "b_file_content", "b_get_batch", "b_cancel_batch", "b_batch_on_a_file")
              if checks[k] == 404]
    leaks = 5 - len(denied) + checks["b_listed"] + (checks["no_key"] != 401)
    # B's five asks and a call without a key: clean errors; B's listing without A's batch: answered
    return {"sent": 7, "answered": int(not checks["b_listed"]), "clean_error": len(denied) + (checks["no_key"] == 401),
            "hung": 0, "broken": leaks, "tenant_leaks": leaks, "checks": checks, "broken_examples": []}


def retry_wait(response: httpx.Response) -> float | None:
    """Seconds to wait before sending ``response``'s request again, as a client does: the
    ``Retry-After`` of a 429 (the engine shedding load); None for anything else."""
    wait = response.headers.get("retry-after") if response.status_code == 429 else None
    return None if wait is None else float(wait)


async def _storm(url: str, headers: dict, body: dict, streams: int, cut_s: float) -> dict[str, int]:
    """Open ``streams`` streaming chats at once and cut each ``cut_s`` after it was sent: how many
    were cut in flight, and the status of those that ended before (a 429 past the queue limit)."""
    async def one(client: httpx.AsyncClient) -> str:
        try:
            async with asyncio.timeout(cut_s):
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_bytes():
                        pass
                    return str(response.status_code)
        except TimeoutError:
            return "cut"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    limits = httpx.Limits(max_connections=streams + 10)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
        outcomes = await asyncio.gather(*(one(client) for _ in range(streams)))
    return {o: outcomes.count(o) for o in sorted(set(outcomes))}


def _pools(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json().get("pools") or {}


def disconnect_storm(url: str, key: str, model: str, streams: int = 200, cut_s: float = 0.5, settle_s: float = 60) -> dict:
    """``streams`` streaming chats cut by the client ``cut_s`` after sending; then a fresh request
    must be served, and the pools' running and waiting requests and KV use must return to where
    they were."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200,
            "stream": True, "ignore_eos": True}
    kv_before = {name: p.get("kv_free_tokens") for name, p in _pools(url).items()}
    outcomes = asyncio.run(_storm(url, headers, body, streams, cut_s))
    t0 = time.monotonic()
    for retry in range(4):  # NOTE: as a client does, a 429 is sent again after its Retry-After (the storm's
        # cancellations may not have reached the engine yet, which sheds on what it still holds)
        fresh = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                           json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        if (wait := retry_wait(fresh)) is None:
            break
        time.sleep(wait)
    fresh_s = round(time.monotonic() - t0, 1)
    deadline, settled_s, pools, trace = time.monotonic() + settle_s, None, {}, []
    while time.monotonic() < deadline:
        pools = _pools(url)
        busy = sum((p.get("num_running") or 0) + (p.get("num_waiting") or 0) for p in pools.values())
        trace.append((round(time.monotonic() - t0, 1), busy))
        # NOTE: a pool the autoscaler took to zero replicas meanwhile has no KV to compare
        kv_back = all(pools.get(n, {}).get("kv_free_tokens") in (kv, None) for n, kv in kv_before.items())
        if busy == 0 and kv_back:
            settled_s = round(time.monotonic() - t0, 1)
            break
        time.sleep(1)
    broken = int(fresh.status_code != 200) + int(settled_s is None)
    unclean = {o: n for o, n in outcomes.items() if o not in ("cut", "200", "429")}
    return {"sent": streams + 1, "answered": int(fresh.status_code == 200) + outcomes.get("200", 0),
            "clean_error": outcomes.get("429", 0), "cut": outcomes.get("cut", 0), "hung": 0,
            "broken": broken + sum(unclean.values()), "storm": outcomes, "fresh_request_s": fresh_s,
            "fresh_request_retries": retry,
            "settled_after_s": settled_s, "running_and_waiting": trace[::5] + trace[-1:], "kv_free_before": kv_before,
            "kv_free_after": {n: p.get("kv_free_tokens") for n, p in pools.items()},
            "broken_examples": [f"{o} x{n}" for o, n in unclean.items()]}
