"""The length-predictor deployment, shared by both pools.

Batches prompts with ``@serve.batch``, serves the MLflow alias ``champion`` and swaps to a newly
promoted version without dropping requests: a background thread polls the registry, loads the new
version beside the old one and swaps one reference; requests in flight finish on the old one.
Without a usable champion it answers with ``max`` reservation (version ``max-fallback``), so the
service comes up and keeps serving; callers still time out and fall back on their side.

The same poll runs the retraining trigger (``deployments/retrain.py``: one per cluster, in a named
actor every replica finds): when the feedback the engine replicas wrote to the store meets the
policy, one Ray task retrains, gates and promotes; the next poll serves the new champion.

The registry's store and the feedback store are read here (``app.paths``, and the app's ``store``),
where the replica starts, and handed down.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from ray import serve
from ray.serve.metrics import Gauge

from app import paths
from app.config import PredictorConfig
from app.runtime_env import process_defaults
from deployments.retrain import ClusterRetrainTrigger
from predictor.store import Store

logger = logging.getLogger("ray.serve")


class LengthPredictorServer:
    """Plain class (testable without Ray); ``PredictorDeployment`` below wraps it for Serve."""

    def __init__(self, config: PredictorConfig | dict | None = None, trigger: "ClusterRetrainTrigger | None" = None,
                 store: Store | None = None, on_registry: "Callable[[bool], None] | None" = None) -> None:
        self.config = PredictorConfig.model_validate(config or {})
        self.registry_error: str | None = None  # why the last registry poll failed; None once one succeeds
        self.on_registry = on_registry  # told whether each poll reached the registry (a metric)
        self.store = store or paths.predictor_store()
        self._predictor = self._load()
        self.swaps = 0
        self.poll_errors = 0
        self.trigger = trigger
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if self.config.source == "champion":
            self._poller = threading.Thread(target=self._poll, name="champion-poll", daemon=True)
            self._poller.start()

    def _load(self):
        from predictor.loading import load_predictor_or_max

        predictor = load_predictor_or_max(self.config.source, store=self.store)
        if self.config.bound_quantile is not None and hasattr(predictor, "bound_quantile"):
            predictor.bound_quantile = self.config.bound_quantile
        predictor.predict(["warm-up"])  # NOTE: the first call is slow (lazy init); not a user's request
        logger.info("length predictor: serving version %s", predictor.version)
        return predictor

    @property
    def version(self) -> str:
        return str(self._predictor.version)

    @property
    def unavailable(self) -> str | None:
        """Why the configured predictor does not serve (max reservation does instead), or None."""
        return getattr(self._predictor, "unavailable", None)
    def refresh(self) -> bool:
        """Load the champion if it is not the version being served; True when it swapped."""
        from predictor import registry

        try:
            self.store.check_answers()  # NOTE: a lost tracking server in seconds, not after MLflow's retries
            champion = registry.champion_version(registry.configure(self.store))
        except Exception as exc:  # noqa: BLE001 - a registry hiccup must not stop serving
            logger.warning("registry poll failed: %s", exc)
            self._registry_polled(f"{type(exc).__name__}: {str(exc)[:300]}")
            return False
        self._registry_polled(None)
        if champion is None or champion == self.version:
            return False
        fresh = self._load()
        if str(fresh.version) != champion:
            return False  # the new version would not load: keep serving the old one
        self._predictor = fresh  # NOTE: one reference swap; in-flight batches keep the old object
        self.swaps += 1
        return True

    def _registry_polled(self, error: str | None) -> None:
        self.registry_error = error
        if self.on_registry is not None:
            self.on_registry(error is None)

    def _poll(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            try:
                self.refresh()
                if self.trigger is not None and self.registry_error is None:  # retraining registers there
                    self.trigger.tick(getattr(self._predictor, "spec", None))
            except Exception:  # noqa: BLE001 - one bad poll (a version that fails its warm-up,
                # a feedback file gone mid-scan) must not end hot swap and retraining for good
                self.poll_errors += 1
                logger.exception("predictor poll failed; serving version %s, next poll in %.0f s",
                                 self.version, self.config.poll_s)

    def predict_batch(self, texts: list[str]) -> list[dict]:
        predictor = self._predictor
        pred = predictor.predict(texts)
        return [
            {
                "bucket": pred.buckets[i],
                "bound_tokens": pred.bound_tokens[i],
                "probabilities": [float(p) for p in pred.probabilities[i]],
                "bucket_range_tokens": predictor.buckets.max_tokens,  # the probabilities' equal buckets cover this
                "expected_tokens": pred.expected_tokens[i] if pred.expected_tokens else None,
                "score": pred.scores[i] if pred.scores else None,
                "rank_tokens": pred.rank_tokens[i] if pred.rank_tokens else None,
                "version": str(predictor.version),
            }
            for i in range(len(texts))
        ]

    def close(self) -> None:
        self._stop.set()


@serve.deployment(name="predictor", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=256)
class PredictorDeployment:
    """``await handle.predict.remote(text) -> dict`` (bucket, bound_tokens, probabilities,
    expected_tokens, score, rank_tokens, version). ``reconfigure`` takes a ``PredictorConfig`` dict."""

    def __init__(self, config: dict | None = None, store: str = "") -> None:
        process_defaults()  # NOTE: a replica is a process of its own; before MLflow is first imported
        self.store = paths.predictor_store()
        self.state = paths.store(store)
        self.registry_up = Gauge("foreserve_predictor_registry_up", "1 when the predictor's last registry poll "
                                 "reached the registry, 0 when it failed (it serves its last champion meanwhile).")
        self.server = self._server(PredictorConfig.model_validate(config or {}))
        self.started_s = time.time()

    def _server(self, config: PredictorConfig) -> LengthPredictorServer:
        trigger = None
        if config.retrain_enabled:
            trigger = ClusterRetrainTrigger(config, self.store, self.state, serve.get_replica_context().app_name)
        return LengthPredictorServer(config, trigger, self.store, on_registry=lambda ok: self.registry_up.set(float(ok)))

    def reconfigure(self, config: dict) -> None:
        fresh = PredictorConfig.model_validate(config or {})
        if fresh == self.server.config:
            return  # Serve calls reconfigure right after __init__ with the same user_config
        old, self.server = self.server, self._server(fresh)
        old.close()

    # NOTE: no batch wait: requests that arrive while a batch runs form the next one, so a lone
    # chat request is not held back and a burst still batches.
    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)
    async def predict(self, texts: list[str]) -> list[dict]:
        # NOTE: inference off the event loop, so info() and new arrivals stay responsive
        return await asyncio.to_thread(self.server.predict_batch, texts)

    def info(self) -> dict:
        info = {"version": self.server.version, "swaps": self.server.swaps, "poll_errors": self.server.poll_errors,
                "up_s": time.time() - self.started_s, "unavailable": self.server.unavailable,
                "registry_error": self.server.registry_error}
        if self.server.trigger is not None:
            info.update(self.server.trigger.info())
        return info
