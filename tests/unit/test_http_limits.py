"""The ingress's HTTP guards on a bare FastAPI app (no Ray): headers past the limit are a 431 in
OpenAI's error shape before any route runs; streaming routes pass through untouched."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from deployments.http_errors import install_error_handlers, install_header_limit

LIMIT = 16 * 1024


def _app() -> tuple[FastAPI, list[str]]:
    app = FastAPI()
    install_error_handlers(app)
    install_header_limit(app, LIMIT)
    calls: list[str] = []

    @app.get("/v1/models")
    async def models() -> dict:
        calls.append("models")
        return {"ok": True}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    return app, calls


def test_headers_past_the_limit_are_431_before_the_route():
    app, calls = _app()
    client = TestClient(app)
    big = client.get("/v1/models", headers={"X-Big": "a" * (1 << 20)})
    assert big.status_code == 431 and calls == []
    assert big.json()["error"]["code"] == "request_header_fields_too_large"
    assert set(big.json()["error"]) == {"message", "type", "param", "code"} and "16384" in big.json()["error"]["message"]
    many = client.get("/v1/models", headers={f"X-{i}": "v" * 100 for i in range(200)})  # 200 small ones add up
    assert many.status_code == 431
    assert client.get("/v1/models", headers={"X-Fine": "a" * 8000}).json() == {"ok": True} and calls == ["models"]
    assert client.get("/stream").text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
