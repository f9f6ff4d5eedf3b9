"""The HTTP front door: OpenAI's chat completions and completions APIs on Ray Serve (FastAPI ingress).

One request's path: auth → body limit → JSON + schema (400 with the failing field) → model id (404)
→ chat template and context checks (400) → the shared predictor (a timeout or failure reserves for
max_tokens, counted) → the pool's engine (``service_tier`` flex → offline, anything else → online).
The first engine item is awaited before any byte is sent, so a pool at its queue limit is a clean
429 with Retry-After and an engine rejection a clean 400: nothing half-accepted. A client that goes
away cancels the handle call, which aborts the request in the engine and frees its KV blocks. The
calls to the pools, requeued or resumed when a replica is lost: ``deployments/pool_calls.py``.

OpenAI's Files and Batch API (``/v1/files``, ``/v1/batches``) run foreserve batch jobs (Ray Jobs on
Ray Data) through this app's offline pool: ``deployments/files_batches.py``. The FastAPI app, its
limits and the auth and body steps every route shares are in ``deployments/http_app.py``.
"""


import asyncio
import json
import logging
import os
import time
import uuid
import weakref
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from app import paths
from app.api import errors
from app.api.keys import ApiKeys, split_list
from app.api.completions import CompletionRequest
from app.api.prompt import request_prompt
from app.api.schemas import ChatCompletionRequest, ModelCard, ModelList
from app.batch.api import BatchStore
from app.config import INHERITED, AppConfig
from app.engine.model.arch import arch_config
from app.engine.request import Prediction, SamplingParams
from app.runtime_env import process_defaults
from deployments.chat import ChatResult, completion, sse_chunks, text_completion, text_sse_chunks
from deployments.engine_server import GenerateRequest
from deployments.files_batches import FilesAndBatches
from deployments.health import report as health_report
from deployments.http_app import DRAIN, app
from deployments.pool_calls import PoolCalls
from deployments.pool_gate import PoolGate, replica_states

logger = logging.getLogger("ray.serve")

def _cancel_unstarted(stream, result: ChatResult) -> None:
    """Cancel ``stream`` if its answer never streamed a byte (its body was dropped unstarted)."""
    if not result.sent_role:
        stream.cancel()


@serve.deployment(name="ingress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(app)
class Ingress(FilesAndBatches):
    def __init__(self, online: DeploymentHandle, offline: DeploymentHandle, predictor: DeploymentHandle, config: dict) -> None:
        from app.engine.text.tokenizer import load_tokenizer
        from app.prepare.model_store import ensure_local_model
        from deployments.metrics import RequestMetrics

        process_defaults()  # NOTE: a replica is a process of its own (offline hub before the tokenizer loads)
        self.config = AppConfig.model_validate(config)
        self.pools = {"online": online, "offline": offline}
        self.predictor = predictor
        online = self.config.pools["online"]  # NOTE: both pools serve the same model
        self.model_id = online.model_id
        self.tokenizer = load_tokenizer(ensure_local_model(online.model_path, paths.store(self.config.store)),
                                        online.chat_template)
        self.limits = {name: pool.sequence_limit_tokens() for name, pool in self.config.pools.items()}
        self.vocab = arch_config(online.model_path)[1].vocab_size  # token ids a completion's prompt may hold
        # NOTE: `foreserve serve` hands the replicas digests of its FORESERVE_API_KEYS, never the keys
        self.api_keys = ApiKeys(self.config.ingress.api_keys + split_list(os.environ.get("FORESERVE_API_KEYS")),
                                split_list(os.environ.get("FORESERVE_API_KEY_SHA256")))
        app.state.max_header_bytes = self.config.ingress.max_header_bytes
        DRAIN.retry_after_s = self.config.ingress.retry_after_s
        self.metrics = RequestMetrics()
        self.predictor_fallbacks = 0
        # NOTE: files and batches live in the store every node sees: any replica answers for any of them
        offline = self.config.pools["offline"]  # the model its batch jobs read their rows for
        self.batches = BatchStore(paths.store(self.config.store), app_name=serve.get_replica_context().app_name,
                                  model={key: getattr(offline, key) for key in INHERITED if getattr(offline, key)})
        self.offline_gate = PoolGate(self._replica_states, "offline")
        self.calls = PoolCalls(self.pools, self.config.ingress, self.offline_gate, self.metrics)

    # -- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        """``deployments/health.py``; always 200 (the ingress itself is up). The first call also warms
        the handles' routing, so the first chat request does not pay it."""
        report = await health_report(self._replica_states, self.pools, self.predictor)
        return JSONResponse({**report, "model": self.model_id, "predictor_fallbacks": self.predictor_fallbacks,
                             "held_flex_requests": self.offline_gate.held_requests})

    def _replica_states(self) -> dict[str, dict[str, int]]:
        return replica_states(self.batches.app_name, self.pools)

    def drain(self) -> int:
        """Take no more requests (503 with Retry-After; ``/health`` 503 ``draining``), answer the flex
        calls held for the offline pool the same way, and return how many requests are still open.
        The open ones go on to their end (``deployments/drain.py``)."""
        DRAIN.draining = True
        self.offline_gate.close()
        return DRAIN.open

    def open_requests(self) -> int:
        return DRAIN.open

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        # NOTE: the longest sequence both pools take: an online request may go to either
        return ModelList(data=[ModelCard(id=self.model_id, max_model_len=min(self.limits.values()))]).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        """A prompt continued as it is (a base model's API; the same pools, predictor and reservation)."""
        return await self._serve(request, CompletionRequest)

    async def _serve(self, request: Request, schema: type[ChatCompletionRequest] | type[CompletionRequest]):
        tier = "online"
        try:
            self._authorize(request)
            body = await self._parse(request, schema)
            tier = body.tier
            response = await self._complete(body)
        except errors.APIError as exc:
            self.metrics.status(tier, exc.status_code)
            raise
        self.metrics.status(tier, 200)
        return response

    # -- steps -------------------------------------------------------------------------------
    async def _parse(self, request: Request, schema):
        data = await self._json(request, self.config.ingress.max_body_bytes)
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            raise errors.from_validation_error(exc) from None
        if body.model != self.model_id:
            raise errors.model_not_found(body.model)
        return body

    def _tokenize(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[list[int], int]:
        """The prompt's tokens and the max_tokens to use, or 400 if they cannot fit the context of
        the pool that will serve it."""
        config = self.config.pools[body.pool]
        return request_prompt(self.tokenizer, body, self.limits[body.pool], config.default_max_tokens, self.vocab)

    async def _predict(self, response, tier: str) -> dict | None:
        """The predictor's answer to ``response`` (a sent ``predict`` call), or None (reserve
        max_tokens) if it fails or is too slow."""
        try:
            return await asyncio.wait_for(response, self.config.predictor.timeout_ms / 1000)
        except Exception as exc:  # noqa: BLE001 - never an error for the user
            response.cancel()
            self.predictor_fallbacks += 1
            self.metrics.fallback(tier)
            logger.warning("length predictor unavailable (%s); reserving for max_tokens", type(exc).__name__)
            return None

    async def _complete(self, body: ChatCompletionRequest | CompletionRequest):
        t0 = time.perf_counter()
        tier = body.tier
        chat = isinstance(body, ChatCompletionRequest)
        text = body.predictor_text(self.tokenizer)
        response = self.predictor.predict.remote(text)  # NOTE: sent now, so it overlaps the chat template
        try:
            ids, max_tokens = self._tokenize(body)
        except errors.APIError:
            response.cancel()
            raise
        pred = await self._predict(response, tier)
        bound = None
        if pred is not None:  # NOTE: what this pool reserves (its bound_quantile): the engine, router and header agree
            bound = min(self.config.pools[body.pool].reservation_bound(
                pred["probabilities"], pred["bound_tokens"], pred.get("bucket_range_tokens")), max_tokens)
        request = GenerateRequest(
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            prompt_token_ids=ids,
            num_prompt_tokens=len(ids),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                    seed=body.seed, stop=body.stop_list, ignore_eos=body.ignore_eos),
            prediction=None if pred is None else Prediction(
                bucket=pred["bucket"], probabilities=pred["probabilities"], bound_tokens=bound,
                rank_tokens=pred.get("rank_tokens"), version=str(pred["version"]),
                predictor_bound_tokens=min(pred["bound_tokens"], max_tokens)),
            predictor_text=text,
        )
        stream, first = await self.calls.start(request, body.pool)
        result = ChatResult(request.request_id, self.model_id, tier, t0, first)
        headers = {
            "x-foreserve-request-id": request.request_id,
            "x-foreserve-pool": body.pool,
            "x-foreserve-predictor-version": "max-fallback" if request.prediction is None else request.prediction.version,
            "x-foreserve-predicted-tokens": str(max_tokens if bound is None else bound),
        }
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._sse(request, body.pool, stream, result, include_usage, sse_chunks if chat else text_sse_chunks)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            async for item in self.calls.answer(request, body.pool, stream, result):
                result.add(item)
        except errors.APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything else mid-answer: retryable for the client
            logger.exception("%s failed while answering", result.request_id)
            raise errors.unavailable(f"The {body.pool} pool failed while answering ({type(exc).__name__})") from None
        self._observe(result)
        return JSONResponse((completion if chat else text_completion)(result).model_dump(), headers=headers)

    def _sse(self, request: GenerateRequest, pool: str, stream, result: ChatResult, include_usage: bool,
             chunks=sse_chunks) -> AsyncIterator[str]:
        """The SSE events of a streamed answer (``_stream_events`` over ``PoolCalls.answer``). A client that
        goes away between the engine's first item and the first byte leaves the body never started,
        and a generator never started runs no ``finally``: when it is dropped unstarted, the
        engine's request is cancelled all the same."""
        events = self._stream_events(self.calls.answer(request, pool, stream, result), result, include_usage, chunks)
        weakref.finalize(events, _cancel_unstarted, stream, result)
        return events

    async def _stream_events(self, items: AsyncIterator[dict], result: ChatResult, include_usage: bool,
                             chunks=sse_chunks) -> AsyncIterator[str]:
        try:
            async for item in items:
                result.add(item)
                for event in chunks(result, item, include_usage):
                    yield event
            self._observe(result)
        except Exception as exc:  # noqa: BLE001 - headers are gone: report in-band, then end the stream
            logger.exception("stream %s failed", result.request_id)
            # NOTE: the type only: a replica's exception carries Ray's traceback, pids and paths
            err = exc if isinstance(exc, errors.APIError) else errors.unavailable(f"generation failed ({type(exc).__name__})")
            yield "data: " + json.dumps(err.body()) + "\n\n"  # e.g. a resume refused with 429 stays a 429's body
        finally:
            # NOTE: closing the generator cancels the engine stream in use when the client went away
            await items.aclose()
        yield "data: [DONE]\n\n"

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Flex calls held while the offline pool is at zero: backlog for ``ElasticPolicy``."""
        return self.offline_gate.stats()

    def _observe(self, result: ChatResult) -> None:
        self.metrics.finished(result.tier, result.ttft_s, time.perf_counter() - result.t0, result.completion_tokens)

