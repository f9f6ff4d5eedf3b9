"""OpenAI's error shape for every failure FastAPI itself answers: our ``APIError``, a bad query
or path parameter (FastAPI's 422), an unknown route or method (Starlette's 404/405); and the
header-size guard (431), a plain ASGI middleware so streamed answers and client disconnects pass
through it untouched."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api import errors


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app`` (the ingress's FastAPI app)."""

    @app.exception_handler(errors.APIError)
    async def _api_error(_: Request, exc: errors.APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _query_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        """A bad query or path parameter (``GET /v1/batches?limit=abc``): OpenAI's 400, not FastAPI's 422."""
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        err = errors.bad_request(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param=param)
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = errors.APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)


class HeaderLimit:
    """431 for a request whose header lines (names and values) add up to more than ``limit`` bytes,
    before any route or body is read. ``limit`` may be a callable, read per request (the ingress
    sets it from its config once the replica starts)."""

    def __init__(self, app: ASGIApp, limit) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit() if callable(self.limit) else self.limit
        if scope["type"] == "http" and limit is not None:
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > limit:
                err = errors.APIError(431, f"The request's headers are {size} bytes; this server takes at most {limit}.",
                                      code="request_header_fields_too_large")
                await JSONResponse(err.body(), status_code=431)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_header_limit(app: FastAPI, limit) -> None:
    """Add ``HeaderLimit`` to ``app`` (``limit``: bytes, or a callable that returns them or None)."""
    app.add_middleware(HeaderLimit, limit=limit)
