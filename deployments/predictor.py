"""The length-predictor deployment, shared by both pools.

Batches prompts with ``@serve.batch``, serves the MLflow alias ``champion`` and swaps to a newly
promoted version without dropping requests: a background thread polls the registry, loads the new
version beside the old one and swaps one reference; requests in flight finish on the old one.
Without a usable champion it answers with ``max`` reservation (version ``max-fallback``), so the
service comes up and keeps serving; callers still time out and fall back on their side.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ray import serve

from app.config import PredictorConfig

logger = logging.getLogger("ray.serve")


class LengthPredictorServer:
    """Plain class (testable without Ray); ``PredictorDeployment`` below wraps it for Serve."""

    def __init__(self, config: PredictorConfig | dict | None = None) -> None:
        self.config = PredictorConfig.model_validate(config or {})
        self._predictor = self._load()
        self.swaps = 0
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if self.config.source == "champion":
            self._poller = threading.Thread(target=self._poll, name="champion-poll", daemon=True)
            self._poller.start()

    def _load(self):
        from predictor.pipeline import load_predictor_or_max

        predictor = load_predictor_or_max(self.config.source)
        if self.config.bound_quantile is not None and hasattr(predictor, "bound_quantile"):
            predictor.bound_quantile = self.config.bound_quantile
        logger.info("length predictor: serving version %s", predictor.version)
        return predictor

    @property
    def version(self) -> str:
        return str(self._predictor.version)

    def refresh(self) -> bool:
        """Load the champion if it is not the version being served; True when it swapped."""
        from predictor import registry

        try:
            champion = registry.champion_version()
        except Exception as exc:  # noqa: BLE001 - a registry hiccup must not stop serving
            logger.warning("registry poll failed: %s", exc)
            return False
        if champion is None or champion == self.version:
            return False
        fresh = self._load()
        if str(fresh.version) != champion:
            return False  # the new version would not load: keep serving the old one
        self._predictor = fresh  # NOTE: one reference swap; in-flight batches keep the old object
        self.swaps += 1
        return True

    def _poll(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            self.refresh()

    def predict_batch(self, texts: list[str]) -> list[dict]:
        predictor = self._predictor
        pred = predictor.predict(texts)
        return [
            {
                "bucket": pred.buckets[i],
                "bound_tokens": pred.bound_tokens[i],
                "probabilities": [float(p) for p in pred.probabilities[i]],
                "expected_tokens": pred.expected_tokens[i] if pred.expected_tokens else None,
                "score": pred.scores[i] if pred.scores else None,
                "version": str(predictor.version),
            }
            for i in range(len(texts))
        ]

    def close(self) -> None:
        self._stop.set()


@serve.deployment(name="predictor", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=256)
class PredictorDeployment:
    """``await handle.predict.remote(text) -> dict`` (bucket, bound_tokens, probabilities,
    expected_tokens, score, version). ``reconfigure`` takes a ``PredictorConfig`` dict."""

    def __init__(self, config: dict | None = None) -> None:
        self.server = LengthPredictorServer(config)
        self.started_s = time.time()

    def reconfigure(self, config: dict) -> None:
        fresh = PredictorConfig.model_validate(config or {})
        if fresh == self.server.config:
            return  # Serve calls reconfigure right after __init__ with the same user_config
        old, self.server = self.server, LengthPredictorServer(fresh)
        old.close()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def predict(self, texts: list[str]) -> list[dict]:
        # NOTE: inference off the event loop, so info() and new arrivals stay responsive
        return await asyncio.to_thread(self.server.predict_batch, texts)

    def info(self) -> dict:
        return {"version": self.server.version, "swaps": self.server.swaps, "up_s": time.time() - self.started_s}
