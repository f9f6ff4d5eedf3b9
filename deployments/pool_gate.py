"""Hold calls for a pool the autoscaler scaled to zero, instead of letting them wake it up.

Ray Serve starts a replica for a deployment at zero replicas as soon as a call queues at its handle
(its cold-start rule runs before any autoscaling policy). For the offline pool that undoes the
elastic policy: the pool yields its replica to a pressured online pool, and the next flex request
brings it straight back. So callers of the offline pool wait here while it has no replica up or
starting. The ingress reports what it holds (``Ingress.record_autoscaling_stats``: ``held_requests``,
``held_tokens``) and ``ElasticPolicy`` counts it as offline backlog: the pool comes back when online
is calm, and the held calls go. A call held past ``max_wait_s`` goes anyway (Serve's cold start then
brings the pool up): flex work may be late, it is never lost.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable

# NOTE: replica states that will serve a call soon; STOPPING (a drained replica) will not
UP_STATES = ("RUNNING", "STARTING", "UPDATING", "RECOVERING")
# NOTE: deploying, or the autoscaler is adding replicas: a queued call wakes nothing it did not decide
OPEN_STATUSES = ("UPDATING", "UPSCALING")
FLEX_MAX_WAIT_S = 600.0


_STATUS_LOCK = threading.Lock()


def serve_status():
    """``serve.status()``, one thread at a time in this process. NOTE: Ray Serve's is not thread-safe:
    building its answer registers the autoscaling policy's module with cloudpickle and unregisters it
    after, so a second thread's unregister raises ``ValueError: ... is not registered for pickle by
    value`` (the ingress asks from threads: its health answer and the flex gate)."""
    from ray import serve

    with _STATUS_LOCK:
        return serve.status()


def replica_states(app_name: str, pools) -> dict[str, dict]:
    """Each pool's deployment status and replica counts by state (RUNNING, STARTING, ...), from
    Serve's controller; ``{}`` for a pool the app does not have."""
    app = serve_status().applications.get(app_name)
    states = {}
    for name in pools:
        d = app.deployments.get(name) if app else None
        states[name] = {"status": getattr(d.status, "value", str(d.status)),
                        **{getattr(k, "value", str(k)): int(v) for k, v in d.replica_states.items()}} if d else {}
    return states


def pool_is_up(state: dict | None) -> bool:
    """Whether a call sent to the pool now would be served without Serve's cold start: ``state`` is
    the deployment's status and replica counts by state (``Ingress._replica_states``). Unknown: up."""
    if not state:
        return True
    return state.get("status") in OPEN_STATUSES or any(state.get(s, 0) > 0 for s in UP_STATES)


class GateFull(Exception):
    """The gate holds as many calls as it may: the caller should refuse this one (429)."""


class GateClosed(Exception):
    """The caller is shutting down (``close``): the held call should be refused (503, retry)."""


class PoolGate:
    """The offline pool's gate at one caller. ``states()`` returns each pool's status and replica
    counts (a controller call, made at most every ``poll_s`` however many calls wait)."""

    def __init__(self, states: Callable[[], dict[str, dict]], pool: str = "offline", poll_s: float = 1.0) -> None:
        self.states = states
        self.pool = pool
        self.poll_s = poll_s
        self.held_requests = 0
        self.held_tokens = 0
        self._open = True
        self._closed = False
        self._checked_at = -math.inf
        self._lock = asyncio.Lock()

    async def is_open(self) -> bool:
        async with self._lock:
            if time.monotonic() - self._checked_at >= self.poll_s:
                try:
                    self._open = pool_is_up((await asyncio.to_thread(self.states)).get(self.pool))
                except Exception:  # noqa: BLE001 - no answer from the controller: let Serve decide
                    self._open = True
                self._checked_at = time.monotonic()
            return self._open

    async def wait(self, tokens: int, max_wait_s: float = FLEX_MAX_WAIT_S, max_held: int | None = None) -> float:
        """Return once the pool is up (or after ``max_wait_s``); the seconds held. While held, the
        call and its ``tokens`` (prompt + predicted output) count in ``held_requests``/``held_tokens``.
        ``GateFull`` if ``max_held`` calls are held already (each holds one of the caller's slots);
        ``GateClosed`` once the gate is closed (the caller is draining) while the pool is down."""
        if await self.is_open():
            return 0.0
        if max_held is not None and self.held_requests >= max_held:
            raise GateFull(self.held_requests)
        t0 = time.monotonic()
        self.held_requests += 1
        self.held_tokens += tokens
        try:
            while time.monotonic() - t0 < max_wait_s:
                if self._closed:
                    raise GateClosed()
                await asyncio.sleep(self.poll_s)
                if await self.is_open():
                    break
        finally:
            self.held_requests -= 1
            self.held_tokens -= tokens
        return time.monotonic() - t0

    def close(self) -> None:
        """Refuse the calls held now and later (``GateClosed``, within ``poll_s``)."""
        self._closed = True

    def stats(self) -> dict[str, float]:
        return {"held_requests": float(self.held_requests), "held_tokens": float(self.held_tokens)}


def wait_until_up(app_name: str, pool: str = "offline", max_wait_s: float = FLEX_MAX_WAIT_S,
                  poll_s: float = 2.0) -> float:
    """The blocking form, for callers outside the ingress (batch rows on the serve backend). Their
    waits are not reported: the pool comes back with the policy's ``offline_idle_replicas``, or after
    ``max_wait_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s:
        try:
            if pool_is_up(replica_states(app_name, [pool]).get(pool)):
                break
        except Exception:  # noqa: BLE001
            break
        time.sleep(poll_s)
    return time.monotonic() - t0
