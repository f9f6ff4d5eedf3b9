"""The ingress's calls to an engine pool: send a request, await its first item before any byte goes
to the client (a pool at its queue limit is a clean 429 with Retry-After, an engine rejection a clean
400: nothing half-accepted), then follow the answer to its end.

A replica that goes away under a request (a scale-down drained it past ``graceful_shutdown_timeout_s``,
or it died) does not lose it: before the first item the request is sent to the pool again; after it,
the answer is resumed on another replica, which recomputes the prompt and the tokens so far, like a
preempted sequence, and goes on from there. Flex calls wait while the autoscaler has the offline pool
at zero (``deployments/pool_gate.py``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from app.api import errors
from app.config import IngressConfig
from deployments.chat import ChatResult
from deployments.engine_server import GenerateRequest
from deployments.pool_gate import GateClosed, GateFull, PoolGate
from deployments.router import reservation_tokens

logger = logging.getLogger("ray.serve")

REPLICA_LOST = (RayActorError, ActorUnavailableError)
REQUEUE_ATTEMPTS = 3


class Resumes(Protocol):
    def resumed(self, tier: str) -> None: ...


def engine_error(error: dict, retry_after_s: int = 2, pool: str = "online") -> errors.APIError:
    """The engine's refusal (400: the prompt and max_tokens do not fit its KV; 429: it sheds load,
    its queue past ``max_queue_delay_ms``, at admission or when the request waited that long
    unstarted: the engine's reason says which) or failure (500)."""
    if error.get("status_code") == 429:
        return errors.overloaded(retry_after_s, pool, f"is too busy to answer in time: {error['message']}")
    if error.get("status_code", 400) == 400:
        return errors.bad_request(error["message"], param="max_tokens", code="context_length_exceeded")
    return errors.server_error(f"The model failed on this request: {error['message']}. Other requests are unaffected.")


async def _rest(stream, first: dict) -> AsyncIterator[dict]:
    """The first item (already received) followed by the rest of the stream; an engine error
    item (this request failed in the engine) raises its OpenAI error."""
    yield first
    if first["finished"]:
        return
    async for item in stream:
        if "error" in item:
            raise engine_error(item["error"])
        yield item
        if item["finished"]:
            return


class PoolCalls:
    """``start`` and ``answer`` over the pools' handles (``online``, ``offline``)."""

    def __init__(self, pools: dict[str, DeploymentHandle], limits: IngressConfig, offline_gate: PoolGate,
                 metrics: Resumes) -> None:
        self.pools, self.limits, self.offline_gate, self.metrics = pools, limits, offline_gate, metrics

    async def start(self, request: GenerateRequest, pool: str, new: bool = True) -> tuple:
        """Send ``request`` to ``pool``; (stream, first item). A replica lost before the first item
        is retried on the pool, up to ``REQUEUE_ATTEMPTS``. ``new``: a request not yet admitted (a
        requeue or a resumed answer already holds its place and is never refused for the flex limit)."""
        payload = request.model_dump()
        for attempt in range(1, REQUEUE_ATTEMPTS + 1):
            if pool == "offline":
                try:
                    max_held = self.limits.flex_max_held if new and attempt == 1 else None
                    await self.offline_gate.wait(reservation_tokens([payload]), self.limits.flex_max_wait_s, max_held)
                except GateFull:
                    raise errors.overloaded(self.limits.retry_after_s, "offline") from None
                except GateClosed:
                    raise errors.shutting_down(self.limits.retry_after_s) from None
            stream = self.pools[pool].options(stream=True).generate.remote(payload)
            try:
                return stream, await self._first_item(stream, pool)
            except REPLICA_LOST as exc:
                stream.cancel()
                if attempt == REQUEUE_ATTEMPTS:
                    logger.exception("%s pool failed before the first token", pool)
                    raise errors.unavailable(f"The {pool} pool is unavailable: {type(exc).__name__}") from None
                logger.warning("%s lost its %s replica before the first token (%s); requeued",
                               request.request_id, pool, type(exc).__name__)
        raise AssertionError("unreachable")

    async def _first_item(self, stream, pool: str) -> dict:
        try:
            first = await stream.__anext__()
        except BackPressureError:
            raise errors.overloaded(self.limits.retry_after_s, pool) from None
        except REPLICA_LOST:
            raise
        except Exception as exc:  # noqa: BLE001 - a dead or missing replica: retryable, not a 500
            logger.exception("%s pool failed before the first token", pool)
            raise errors.unavailable(f"The {pool} pool is unavailable: {type(exc).__name__}") from None
        if "error" in first:
            raise engine_error(first["error"], self.limits.retry_after_s, pool)
        return first

    async def answer(self, request: GenerateRequest, pool: str, stream, result: ChatResult) -> AsyncIterator[dict]:
        """The engine's items for ``request`` (``result.first`` first), resumed on another replica of
        the pool when the one answering is lost (up to ``REQUEUE_ATTEMPTS`` times)."""
        first = result.first
        try:
            for attempt in range(1, REQUEUE_ATTEMPTS + 1):
                try:
                    async for item in _rest(stream, first):
                        yield item
                    stream = None  # answered: nothing left to cancel
                    return
                except REPLICA_LOST as exc:
                    stream.cancel()
                    if attempt == REQUEUE_ATTEMPTS:
                        raise errors.unavailable(f"The {pool} pool failed while answering: {type(exc).__name__}") from None
                    done = len(result.token_ids)
                    logger.warning("%s lost its %s replica after %d tokens (%s); resuming on another",
                                   request.request_id, pool, done, type(exc).__name__)
                    self.metrics.resumed(result.tier)
                    if done >= request.sampling.max_tokens:  # only the final item was lost
                        stream = None
                        yield {"request_id": request.request_id, "text": "", "finished": True, "finish_reason": "length",
                               "prompt_tokens": result.prompt_tokens, "completion_tokens": done, "token_ids": []}
                        return
                    resumed = request.model_copy(update={"resume_output_token_ids": list(result.token_ids),
                                                         "resume_emitted_chars": len(result.text)})
                    stream, first = await self.start(resumed, pool, new=False)
        finally:
            if stream is not None:  # the client went away, or the answer failed: stop the engine's work
                stream.cancel()
