"""The ingress's FastAPI app and what every route shares: the limits installed on the app (error
shapes, header size, drain), and ``HttpEdge``, the steps a route takes before its own work: the
caller's key (401) and a body read within a byte limit (413) and parsed as a JSON object (400)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request

from app.api import errors
from app.api.keys import ApiKeys
from app.api.completions import CompletionRequest
from app.api.schemas import ChatCompletionRequest
from app.batch.api import BatchCreate
from deployments.drain import DrainState, install_drain
from deployments.http_errors import install_error_handlers, install_header_limit
from deployments.openapi import document_bodies

app = FastAPI(title="foreserve", description="OpenAI-compatible chat and completions with output-length prediction.")

install_error_handlers(app)
install_header_limit(app, lambda: getattr(app.state, "max_header_bytes", None))  # set by Ingress.__init__
DRAIN = DrainState()  # this replica's; `foreserve serve` drains it before stopping (Ingress.drain)
install_drain(app, DRAIN)
document_bodies(app, {("/v1/chat/completions", "post"): ChatCompletionRequest, ("/v1/completions", "post"): CompletionRequest,
                      ("/v1/batches", "post"): BatchCreate})


class HttpEdge:
    """Authentication and body reading for the routes of a class that sets ``api_keys``."""

    api_keys: ApiKeys

    def _authorize(self, request: Request) -> str | None:
        """The caller's tenant: its key's digest (files and batches are its own); None when the app
        has no keys (one tenant). 401 for anything but an accepted bearer key."""
        if not self.api_keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        tenant = self.api_keys.tenant(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise errors.unauthorized()
        return tenant

    async def _body(self, request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise errors.too_large(limit)
        raw = bytearray()
        async for piece in request.stream():  # NOTE: also bounds bodies sent without Content-Length
            raw += piece
            if len(raw) > limit:
                raise errors.too_large(limit)
        return bytes(raw)

    async def _json(self, request: Request, limit: int) -> dict:
        raw = await self._body(request, limit)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: "[[[[..." nested too deep
            raise errors.bad_request("We could not parse the JSON body of your request.", code="invalid_json") from None
        if not isinstance(data, dict):
            raise errors.bad_request("The request body must be a JSON object.", code="invalid_json")
        return data
