"""The engine server: one deployment class, used twice (the online and the offline pool).

Each replica owns one ``LLMEngine`` (and, with ``tensor_parallel_size > 1``, its TP ranks) behind
an ``AsyncLLMEngine``. ``generate`` streams plain dicts through a streaming DeploymentHandle; a
caller that stops iterating aborts the request, which frees its KV blocks. A request the engine
can never run comes back as one ``{"error": ...}`` item (typed, so it survives the process hop).
Every finished request's feedback record goes to the store, flushed in the background. ``record_routing_stats`` publishes what the
KV-aware router and the autoscaling policies need, and refreshes the pool's Prometheus gauges.
"""

from __future__ import annotations

import collections
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from app import paths
from app.config import EngineConfig, load_pool_config
from app.engine.async_engine import AsyncLLMEngine
from app.engine.engine import EngineOverloaded, LLMEngine, RequestRejected
from app.engine.request import EngineRequest, Prediction, SamplingParams
from app.engine.shedding import awaiting_first_token
from app.prepare.model_store import ensure_local_model
from app.runtime_env import process_defaults, traced
from predictor.buckets import LengthBuckets

logger = logging.getLogger("ray.serve")

FEEDBACK_FLUSH_S = 1.0  # feedback reaches the store this often (a killed replica loses at most this much)
LATENCY_WINDOW_S = 30.0  # recent_ttft_ms_p90 / recent_tpot_ms_p90 cover requests finished this recently


class GenerateRequest(BaseModel):
    """What the ingress hands a pool (already validated against the OpenAI schema)."""

    model_config = ConfigDict(extra="forbid")  # NOTE: a stale caller's field fails here, not silently

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    messages: list[dict] = Field(default_factory=list, description="Chat messages for the model's chat template.")
    prompt_token_ids: list[int] | None = Field(None, description="The rendered prompt's tokens (the ingress counted them); else messages are rendered here.")
    num_prompt_tokens: int | None = Field(None, description="len(prompt_token_ids): what the KV-aware router reads.")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    prediction: Prediction | None = Field(None, description="What the predictor said, with the bound this pool reserves (its bound_quantile); None: the engine's own predictor (max_tokens without one).")
    predictor_text: str | None = Field(None, description="The text the predictor read (kept in the feedback record).")
    resume_output_token_ids: list[int] = Field(default_factory=list, description="An answer resumed from a lost replica: the tokens it already generated (recomputed, not sent again).")
    resume_emitted_chars: int = Field(0, ge=0, description="Characters of that answer the client already received.")


class PredictionWindow:
    """How well the served predictions matched, over the last ``size`` naturally finished requests."""

    def __init__(self, buckets: LengthBuckets, size: int = 200) -> None:
        self.buckets = buckets
        self.hits: collections.deque[tuple[bool, bool]] = collections.deque(maxlen=size)

    def add(self, prediction: Prediction | None, output_tokens: int, finish_reason: str | None) -> None:
        if prediction is None or finish_reason != "stop":  # a cut-off answer's true length is unknown
            return
        actual = self.buckets.bucket_of(min(output_tokens, self.buckets.max_tokens))
        self.hits.append((abs(actual - prediction.bucket) <= 1, output_tokens <= prediction.bound_tokens))

    def rates(self) -> tuple[float, float] | None:
        """(within-1-bucket accuracy, share whose bound held), or None before any finished request."""
        if not self.hits:
            return None
        n = len(self.hits)
        return sum(h[0] for h in self.hits) / n, sum(h[1] for h in self.hits) / n


class EngineServer:
    """Plain class (usable without Serve); ``EngineServerDeployment`` wraps it."""

    def __init__(self, pool: str = "online", engine: EngineConfig | dict | None = None, store: str = "",
                 on_crash: Callable[[BaseException], None] | None = None,
                 on_ttft_ratio: Callable[[float], None] | None = None) -> None:
        """``on_crash``: what the engine loop calls if it dies (``AsyncLLMEngine``); ``on_ttft_ratio``:
        each first token's estimate over its measured time (the pool's histogram)."""
        from predictor.feedback import FeedbackWriter

        process_defaults()  # NOTE: a replica started by `serve run` has none of the CLI's settings

        self.pool = pool
        self.config = traced(load_pool_config(pool) if engine is None else EngineConfig.model_validate(engine))
        ensure_local_model(self.config.model_path, paths.store(store))  # a node without it fetches it from the store
        # NOTE: feedback goes to the store from a background thread: a finished request never waits on it
        self.feedback = FeedbackWriter(paths.feedback_store(store), flush_s=FEEDBACK_FLUSH_S)
        self.engine = LLMEngine.from_config(self.config, feedback=self.feedback)
        self.aengine = AsyncLLMEngine(self.engine, on_crash=on_crash)
        self.window = PredictionWindow(self.engine.buckets)
        # request_id -> wall-clock times at which each item left the engine (serving-overhead benchmark)
        self.emit_times: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        # (observed at, seconds) of recent first tokens and finished requests' TPOT: the autoscaler's
        # SLO signals over a time window
        self.ttfts: collections.deque[tuple[float, float]] = collections.deque(maxlen=512)
        self.tpots: collections.deque[tuple[float, float]] = collections.deque(maxlen=512)
        self.on_ttft_ratio = on_ttft_ratio

    def render(self, messages: list[dict]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    async def generate(self, request: dict | GenerateRequest) -> AsyncIterator[dict]:
        req = GenerateRequest.model_validate(request)
        prompt = None if req.prompt_token_ids else self.render(req.messages)
        stream = self.aengine.generate(EngineRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            prompt=prompt,
            sampling=req.sampling,
            tier=self.pool,
            prediction=req.prediction,
            predictor_text=req.predictor_text,
            resume_output_token_ids=req.resume_output_token_ids,
            resume_emitted_chars=req.resume_emitted_chars,
        ))
        emitted = self._emit_log(req.request_id)
        try:
            async for out in stream:
                if out.error is not None:  # this request alone failed (NaN logits: 500) or was refused unstarted (429)
                    yield {"request_id": out.request_id, "error": {"status_code": 429 if out.retryable else 500,
                                                                   "message": out.error}}
                    return
                emitted.append(time.time())
                if len(emitted) == 2 and not req.resume_output_token_ids:  # the first token: TTFT counts now
                    self.ttfts.append((emitted[1], emitted[1] - emitted[0]))
                if out.ttft_s is not None:
                    self._first_token(out)
                finish_reason = out.finish_reason
                if out.finished:
                    self.window.add(req.prediction, out.num_output_tokens, finish_reason)
                    self._record_latency(emitted)
                yield {
                    "request_id": out.request_id,
                    "text": out.text_delta,
                    "finished": out.finished,
                    "finish_reason": finish_reason,
                    "prompt_tokens": out.num_prompt_tokens,
                    "completion_tokens": out.num_output_tokens,
                    "token_ids": out.new_token_ids,
                }
        except RequestRejected as exc:
            yield {"request_id": req.request_id, "error": {"status_code": 400, "message": str(exc)}}
        except EngineOverloaded as exc:  # load shedding: the ingress answers 429 with Retry-After
            yield {"request_id": req.request_id, "error": {"status_code": 429, "message": str(exc)}}

    def _first_token(self, out) -> None:
        """The engine's time to this request's first token beside the estimate made at its admission."""
        estimate = out.ttft_estimate_s
        logger.info("request %s: first token in %.3f s, estimated %s", out.request_id, out.ttft_s,
                    "-" if estimate is None else f"{estimate:.3f} s",
                    extra={"ttft_s": out.ttft_s, "ttft_estimate_s": estimate})
        if estimate is not None and out.ttft_s > 0 and self.on_ttft_ratio is not None:
            self.on_ttft_ratio(estimate / out.ttft_s)

    def _record_latency(self, emitted: list[float]) -> None:
        if len(emitted) > 2:
            self.tpots.append((emitted[-1], (emitted[-1] - emitted[1]) / (len(emitted) - 2)))

    def recent_latency_ms(self, window_s: float = LATENCY_WINDOW_S) -> tuple[float, float]:
        """p90 TTFT of the first tokens and p90 TPOT of the requests finished in the last ``window_s``
        (ms; 0 if none).

        NOTE: a time window, not the last N requests: after a burst the signal must decay even when
        no request finishes (an idle pool is calm), or the autoscaler would see the burst forever."""
        def p90(samples: collections.deque) -> float:
            values = sorted(v for t, v in list(samples) if t >= since)
            return values[int(0.9 * (len(values) - 1))] * 1000 if values else 0.0

        since = time.time() - window_s
        return p90(self.ttfts), p90(self.tpots)

    def oldest_pending_ms(self, requests: list) -> float:
        """How long the oldest request still without its first token has waited (ms): TTFT pressure
        seen while it builds up, before any of those requests has a TTFT to report."""
        pending = [r.arrival_s for r in awaiting_first_token(requests)]
        return max(0.0, (self.engine.clock() - min(pending)) * 1000) if pending else 0.0

    def _emit_log(self, request_id: str) -> list[float]:
        log = self.emit_times[request_id] = [time.time()]
        while len(self.emit_times) > 256:
            self.emit_times.popitem(last=False)
        return log

    def routing_stats(self) -> dict:
        """KV left after what is promised, waiting predicted work: the router's and autoscaler's inputs."""
        stats = self.engine.stats()
        try:  # NOTE: read from the Serve thread while the engine thread mutates the queues
            waiting = list(self.engine.scheduler.waiting)
            running = list(self.engine.scheduler.running)
        except RuntimeError:
            waiting, running = [], []
        rates = self.window.rates()
        ttft_ms, tpot_ms = self.recent_latency_ms()
        return {
            "kv_capacity_tokens": stats.kv_capacity_tokens,
            "kv_used_tokens": stats.kv_used_tokens,
            "kv_free_tokens": stats.kv_capacity_tokens - stats.kv_used_tokens,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "waiting_predicted_tokens": sum(r.num_prompt_tokens + r.predicted_output_tokens for r in waiting),
            "preemptions": stats.preemptions,
            "recomputed_tokens": stats.recomputed_tokens,
            "output_tokens": stats.output_tokens,
            "predictor_fallbacks": stats.predictor_fallbacks,
            "predictor_within1_acc": None if rates is None else rates[0],
            "predictor_bound_held": None if rates is None else rates[1],
            "recent_ttft_ms_p90": ttft_ms,
            "recent_tpot_ms_p90": tpot_ms,
            "oldest_pending_ms": self.oldest_pending_ms(waiting + running),
            "ttft_slo_ms": self.config.ttft_slo_ms,
            "tpot_slo_ms": self.config.tpot_slo_ms,
            "reported_at_s": time.time(),
        }

    def shutdown(self) -> None:
        self.aengine.shutdown()
        try:
            self.feedback.close()  # what the last second finished
        except Exception:  # noqa: BLE001 - the store is gone: the records are lost, the shutdown is not
            logger.exception("could not store the last feedback records")


def _end_replica(exc: BaseException) -> None:
    """The engine loop died (a forward that raised: a kernel or device fault): end this replica's
    process, like a crash would, rather than fail every open answer. Serve starts a new replica and
    the ingress resumes each open answer there (as after a SIGKILL); a replica left up with a dead
    loop would fail each request sent to it until three health checks had failed."""
    logger.critical("engine loop died (%r); ending the replica so that Serve replaces it", exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
class EngineServerDeployment:
    """Bind with ``(pool, engine_config_dict)``; call ``handle.options(stream=True).generate``."""

    def __init__(self, pool: str = "online", engine: dict | None = None, store: str = "") -> None:
        from deployments.metrics import PoolMetrics

        self.metrics = PoolMetrics(pool)
        self.server = EngineServer(pool, engine, store, on_crash=_end_replica, on_ttft_ratio=self.metrics.ttft_ratio)

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        async for item in self.server.generate(request):
            yield item

    def stats(self) -> dict:
        return self.server.routing_stats()

    def emit_times(self, request_id: str) -> list[float] | None:
        """Wall-clock arrival then one time per streamed item, for a recent request (benchmarks)."""
        return self.server.emit_times.get(request_id)

    def record_routing_stats(self) -> dict:
        stats = self.server.routing_stats()
        self.metrics.update(stats)
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The numeric routing stats, for Serve's custom autoscaling policies."""
        stats = self.server.routing_stats()
        return {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and k != "reported_at_s"}

    def check_health(self) -> None:
        """Serve's health check: fails if the engine loop died or stalled with requests waiting
        (``stall_timeout_s``). A replica frozen whole (SIGSTOP) never answers: Serve's
        ``health_check_timeout_s`` catches that one."""
        limit = self.server.config.stall_timeout_s
        self.server.aengine.check(limit if self.server.engine.scheduler.stats.steps else 10 * limit)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()
