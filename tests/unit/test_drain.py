"""The ingress's drain on a bare FastAPI app (no Ray), driven as a server drives ASGI: once
draining, new requests get a 503 in OpenAI's shape with Retry-After and ``/health`` a 503 that says
so, while a stream that was open goes on to its end; a stream counts as open until its last byte."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from deployments.drain import DrainState, install_drain


def _app(state: DrainState, release: asyncio.Event) -> FastAPI:
    app = FastAPI()
    install_drain(app, state)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def body():
            yield "data: 1\n\n"
            await release.wait()
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("boom")

    return app


async def _call(app: FastAPI, method: str, path: str, sent: list[dict]) -> None:
    """One request through ``app``; every message it sends lands in ``sent``."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    done = asyncio.Event()

    async def receive() -> dict:
        if not done.is_set():
            done.set()
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # no disconnect: wait forever

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)


def _status(sent: list[dict]) -> tuple[int, dict, bytes]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_draining_refuses_new_requests_and_lets_open_streams_finish():
    state, release = DrainState(retry_after_s=3), asyncio.Event()
    app = _app(state, release)
    health: list[dict] = []
    await _call(app, "GET", "/health", health)
    assert _status(health)[0] == 200 and state.open == 0

    stream: list[dict] = []
    task = asyncio.ensure_future(_call(app, "POST", "/v1/chat/completions", stream))
    while not any(m.get("body") for m in stream):
        await asyncio.sleep(0.01)
    assert state.open == 1
    state.draining = True

    refused: list[dict] = []
    await _call(app, "POST", "/v1/chat/completions", refused)
    status, headers, body = _status(refused)
    assert status == 503 and headers["retry-after"] == "3"
    error = json.loads(body)["error"]
    assert error["code"] == "service_unavailable" and set(error) == {"message", "type", "param", "code"}
    health = []
    await _call(app, "GET", "/health", health)
    status, headers, body = _status(health)
    assert status == 503 and json.loads(body)["status"] == "draining" and headers["retry-after"] == "3"
    assert state.open == 1  # refused requests never count

    release.set()
    await asyncio.wait_for(task, 5)
    assert _status(stream)[2].endswith(b"data: [DONE]\n\n") and state.open == 0


async def test_a_request_that_fails_is_not_left_open():
    state = DrainState()
    app = _app(state, asyncio.Event())
    sent: list[dict] = []
    try:
        await _call(app, "GET", "/boom", sent)
    except RuntimeError:
        pass
    assert state.open == 0
