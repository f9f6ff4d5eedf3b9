"""OpenAI's error shape for every failure FastAPI itself answers: our ``APIError``, a bad query
or path parameter (FastAPI's 422), an unknown route or method (Starlette's 404/405)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
