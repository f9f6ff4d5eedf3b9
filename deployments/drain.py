"""A graceful drain of the HTTP front door, as `foreserve serve` does on SIGTERM or Ctrl-C.

``Drain`` is a plain ASGI middleware (streamed answers and client disconnects pass through it
untouched) that counts the requests open at this ingress replica until their last byte. Once its
state is ``draining``, a new request gets a 503 in OpenAI's shape with ``Retry-After`` (a client
retries it against the restarted service or another one, never sees a reset) and ``/health`` a 503
that says ``draining`` (a load balancer takes the replica out); the open requests go on to their
end. The launcher waits for ``open`` to reach zero (``deployments/launch.py: drain``), then stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import errors


@dataclass
class DrainState:
    draining: bool = False
    open: int = 0  # HTTP requests taken and not yet answered to their last byte
    retry_after_s: int = 2


class Drain:
    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await self._refuse(scope, receive, send)
            return
        self.state.open += 1
        counted = True

        async def send_counted(message: Message) -> None:
            nonlocal counted
            await send(message)
            if counted and message["type"] == "http.response.body" and not message.get("more_body", False):
                counted = False
                self.state.open -= 1

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if counted:  # failed, or the client went away before the last byte
                self.state.open -= 1

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        retry = {"Retry-After": str(self.state.retry_after_s)}
        if scope["path"] == "/health":
            response = JSONResponse({"status": "draining", "problems": ["shutting down"]}, status_code=503, headers=retry)
        else:
            err = errors.shutting_down(self.state.retry_after_s)
            response = JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)
        await response(scope, receive, send)


def install_drain(app: FastAPI, state: DrainState) -> None:
    """Add ``Drain`` to ``app``, outermost: a draining replica refuses before any other check."""
    app.add_middleware(Drain, state=state)
