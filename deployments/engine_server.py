"""The engine server: one deployment class, used twice (the online and the offline pool).

Each replica owns one ``LLMEngine`` (and, with ``tensor_parallel_size > 1``, its TP ranks) behind
an ``AsyncLLMEngine``. ``generate`` streams plain dicts through a streaming DeploymentHandle; a
caller that stops iterating aborts the request, which frees its KV blocks. Every finished
request appends its feedback record. ``record_routing_stats`` publishes what the KV-aware router
and the autoscaling policies need.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field
from ray import serve

from app.config import load_pool_config
from app.engine.async_engine import AsyncLLMEngine
from app.engine.engine import FINISH_REASONS, LLMEngine
from app.engine.request import SamplingParams


class GenerateRequest(BaseModel):
    """What the ingress hands a pool (already validated against the OpenAI schema)."""

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    messages: list[dict] = Field(min_length=1, description="Chat messages for the model's chat template.")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    prediction: tuple[int, list[float] | None, int] | None = Field(None, description="(bucket, probabilities, bound_tokens) from the predictor deployment.")
    predictor_text: str | None = Field(None, description="The text the predictor read (kept in the feedback record).")
    predictor_version: str | None = None


class EngineServer:
    """Plain class (usable without Serve); ``EngineServerDeployment`` wraps it."""

    def __init__(self, pool: str = "online", config_path: str | None = None, overrides: dict | None = None) -> None:
        from predictor.feedback import FeedbackWriter

        self.pool = pool
        self.config = load_pool_config(pool, config_path, **(overrides or {}))
        self.engine = LLMEngine.from_config(self.config, feedback=FeedbackWriter())
        self.aengine = AsyncLLMEngine(self.engine)

    def render(self, messages: list[dict]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    async def generate(self, request: dict | GenerateRequest) -> AsyncIterator[dict]:
        req = GenerateRequest.model_validate(request)
        stream = self.aengine.generate(
            request_id=req.request_id,
            prompt=self.render(req.messages),
            sampling=req.sampling,
            tier=self.pool,
            prediction=req.prediction,
            predictor_text=req.predictor_text,
            predictor_version=req.predictor_version,
        )
        async for out in stream:
            yield {
                "request_id": out.request_id,
                "text": out.text_delta,
                "finished": out.finished,
                "finish_reason": FINISH_REASONS.get(out.finish_reason or "", out.finish_reason),
                "prompt_tokens": out.num_prompt_tokens,
                "completion_tokens": out.num_output_tokens,
            }

    def routing_stats(self) -> dict:
        """KV left after what is promised, waiting predicted work: the router's and autoscaler's inputs."""
        stats = self.engine.stats()
        try:  # NOTE: read from the Serve thread while the engine thread mutates the queue
            waiting = list(self.engine.scheduler.waiting)
        except RuntimeError:
            waiting = []
        return {
            "kv_capacity_tokens": stats.kv_capacity_tokens,
            "kv_used_tokens": stats.kv_used_tokens,
            "kv_free_tokens": stats.kv_capacity_tokens - stats.kv_used_tokens,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "waiting_predicted_tokens": sum(r.num_prompt_tokens + r.predicted_output_tokens for r in waiting),
            "predictor_fallbacks": stats.predictor_fallbacks,
        }

    def shutdown(self) -> None:
        self.aengine.shutdown()


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=128)
class EngineServerDeployment:
    """Bind with ``(pool, config_path, overrides)``; call ``handle.options(stream=True).generate``."""

    def __init__(self, pool: str = "online", config_path: str | None = None, overrides: dict | None = None) -> None:
        self.server = EngineServer(pool, config_path, overrides)

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        async for item in self.server.generate(request):
            yield item

    def stats(self) -> dict:
        return self.server.routing_stats()

    def record_routing_stats(self) -> dict:
        return self.server.routing_stats()

    def check_health(self) -> None:
        if not self.server.aengine.healthy:
            raise RuntimeError(f"{self.server.pool} engine loop is dead")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()
