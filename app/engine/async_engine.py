"""AsyncLLMEngine: an asyncio streaming front for LLMEngine.

The engine steps in one background thread (the model forward releases the GIL in torch ops);
callers on any event loop submit and abort through a thread-safe inbox and receive their
outputs on a per-request asyncio queue. A caller that stops iterating (client disconnect,
cancellation) aborts its request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from app.engine.engine import LLMEngine
from app.engine.outputs import RequestOutput
from app.engine.request import EngineRequest

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the replica must be restarted."""


class EngineStalledError(RuntimeError):
    """The engine loop is alive but has finished no step for too long while it has requests."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, on_crash: Callable[[BaseException], None] | None = None) -> None:
        """``on_crash``: called from the engine thread if the loop dies, instead of failing the open
        streams (a Serve replica ends its process there: Serve replaces it, and the ingress resumes
        the open answers on the new replica). Without it each open stream raises ``EngineDeadError``."""
        self.engine = engine
        self._on_crash = on_crash
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None
        self._progress_s = time.monotonic()  # when the loop last finished a step or found nothing to do
        self._thread = threading.Thread(target=self._run, name="foreserve-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def check(self, stall_s: float) -> None:
        """Raise if the loop died, or if it has had requests but finished no step for ``stall_s``
        seconds (a hung forward or a deadlock: alive, answering pings, serving nothing)."""
        if not self.healthy:
            raise EngineDeadError(f"engine loop is dead: {self.error!r}")
        waited = time.monotonic() - self._progress_s
        if waited > stall_s and (self.engine.has_unfinished_requests() or not self._inbox.empty()):
            raise EngineStalledError(f"engine loop alive but no step finished in {waited:.0f} s with requests waiting "
                                     f"(limit {stall_s:g} s)")

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs (a fresh request id is given if it has none).

        Raises the engine's validation error (e.g. ``RequestRejected``) on the first iteration.
        """
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        if request.request_id is None:
            request = dataclasses.replace(request, request_id=uuid.uuid4().hex)
        request_id = request.request_id
        if request_id in self._streams:  # NOTE: else the second caller's exit would drop the first's stream
            raise ValueError(f"duplicate request id {request_id!r}")
        stream: asyncio.Queue = asyncio.Queue()
        entry = (asyncio.get_running_loop(), stream)
        self._streams[request_id] = entry
        if not self.healthy:  # the loop crashed between the check above and the registration
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self._send(("add", request_id, request))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is entry:
                del self._streams[request_id]
            if not finished:
                self._send(("abort", request_id, None))

    def close(self) -> None:
        """Stop the engine loop; the engine and its runner stay usable."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def shutdown(self) -> None:
        """Stop the loop and release the runner (rank processes, devices)."""
        self.close()
        self.engine.shutdown()

    # -- engine thread -------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, request_id, request = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "abort":
                self.engine.abort(request_id)
                continue
            try:
                self.engine.add_request(request)
            except Exception as exc:  # validation errors go back to the caller
                self._deliver(request_id, exc)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    self._progress_s = time.monotonic()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self._progress_s = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
            log.exception("engine loop crashed")
            self.error = exc
            if self._on_crash is not None:
                self._on_crash(exc)
                return
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"engine loop crashed: {exc!r}"))
