"""The ingress's OpenAPI schema names the bodies its routes read themselves (no Ray)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from app.api.schemas import ChatCompletionRequest
from app.batch.api import BatchCreate
from deployments.openapi import document_bodies


def test_routes_that_read_their_own_body_document_it():
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        return {}

    @app.post("/v1/batches")
    async def batches(request: Request) -> dict:
        return {}

    document_bodies(app, {("/v1/chat/completions", "post"): ChatCompletionRequest, ("/v1/batches", "post"): BatchCreate})
    schema = TestClient(app).get("/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    chat_schema = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat_schema["required"]) and "max_tokens" in chat_schema["properties"]
    assert "BatchCreate" in schema["components"]["schemas"]
    refs = [v for v in _values(schema) if isinstance(v, str) and v.startswith("#/")]
    assert all(r.removeprefix("#/components/schemas/") in schema["components"]["schemas"] for r in refs), refs


def _values(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _values(v)
    elif isinstance(node, list):
        for v in node:
            yield from _values(v)
    else:
        yield node
