"""The retraining trigger, one per cluster.

``RetrainTrigger`` decides, on every poll of the predictor deployment, whether the feedback written
since the last retraining (the registry's watermark, ``predictor.training.retrain``) calls for
another one, and submits it as a Ray task; it holds off after a retrain that failed or declined.

Every predictor replica polls, but the decision runs in one place: a named Ray actor
(``RetrainActor``, one per Serve app) that the first replica to poll creates and the others find
by name (``ClusterRetrainTrigger``). Two replicas therefore never retrain at once, and a second
retrain never starts on the same records: the actor checks and submits in one call, and the
watermark moves in the registry, which every node reads. The actor belongs to the replica that
created it; if that replica goes, the next poll of any replica creates it again (a retrain it had
in flight is given up, and the feedback it would have used stays new).
"""

from __future__ import annotations

import logging
import time

from app.config import PredictorConfig
from app.runtime_env import process_defaults
from predictor.object_store import ObjectStore
from predictor.store import Store

logger = logging.getLogger("ray.serve")
NAMESPACE = "foreserve"
CALL_TIMEOUT_S = 60.0  # a tick scans the feedback; a trigger that takes longer is reported, not waited on


class RetrainTrigger:
    """Submits one retraining Ray task at a time when new feedback meets the policy."""

    def __init__(self, config: PredictorConfig, store: Store, state: ObjectStore) -> None:
        self.policy = config.retrain
        self.store = store  # the predictor registry
        self.state = state  # foreserve's store: the feedback, and the model for traces where the task runs
        self.feedback = state.child("feedback")
        self.running = None  # ObjectRef of the retraining task in flight
        self.last_summary: dict | None = None
        self.submitted = 0
        self.hold_until_s = 0.0  # after a retrain that failed or declined: no new one before this

    def tick(self, spec) -> None:
        """``spec``: the serving champion's ``ModelSpec`` (its buckets judge mispredictions); None
        when no learned champion serves (nothing to continue from)."""
        import ray

        from predictor.training.retrain import retrain_due

        if self.running is not None:
            done, _ = ray.wait([self.running], timeout=0)
            if not done:
                return
            try:
                self.last_summary = ray.get(self.running)
                logger.info("predictor retraining finished: %s", self.last_summary)
            except Exception as exc:  # noqa: BLE001 - a failed retrain leaves the champion serving
                self.last_summary = {"retrained": False, "reason": f"failed: {exc}"}
                logger.error("predictor retraining failed: %s", exc)
            self.running = None
            if not self.last_summary.get("retrained"):  # NOTE: else the next poll would submit it again
                self.hold_until_s = time.monotonic() + self.policy.retry_after_s
        if time.monotonic() < self.hold_until_s or spec is None:
            return
        reason = retrain_due(self.policy, spec, self.feedback, self.store)
        if reason is not None:
            logger.info("retraining the predictor: %s", reason)
            task = ray.remote(num_cpus=self.policy.num_cpus, max_retries=0)(retrain_here)
            self.running = task.remote(self.policy, self.store, self.state)
            self.submitted += 1

    def info(self) -> dict:
        return {"retrains_submitted": self.submitted, "retrain_running": self.running is not None,
                "last_retrain": self.last_summary}


def retrain_here(policy, store: Store, state: ObjectStore) -> dict:
    """The retraining task, on whatever node Ray runs it: that node's process defaults, and the
    traces whose examples the policy mixes in built there (from the packaged dataset, with the model
    fetched from the store if the node lacks it), then ``retrain_from_feedback``."""
    from app import paths
    from predictor.training.retrain import retrain_from_feedback

    process_defaults()
    trace_dir = None
    if policy.original_examples:
        from app.prepare.model_store import ensure_local_model
        from app.prepare.traces import ensure_traces

        ensure_local_model(paths.model_dir(), state)
        trace_dir = ensure_traces()
    return retrain_from_feedback(policy, state.child("feedback"), store=store, trace_dir=trace_dir)


class RetrainActor:
    """``RetrainTrigger`` as the cluster's one named actor (0 CPUs: it decides, the task trains)."""

    def __init__(self, config: dict, store: Store, state: ObjectStore) -> None:
        process_defaults()
        self.trigger = RetrainTrigger(PredictorConfig.model_validate(config), store, state)

    def tick(self, spec, policy: dict) -> dict:
        self.trigger.policy = PredictorConfig.model_validate({"retrain": policy}).retrain  # the latest reconfigure's
        self.trigger.tick(spec)
        return self.trigger.info()

    def info(self) -> dict:
        return self.trigger.info()


class ClusterRetrainTrigger:
    """A replica's side of the one trigger: finds (or creates) the app's ``RetrainActor`` by name and
    lets it decide. Same ``tick``/``info`` as ``RetrainTrigger``."""

    def __init__(self, config: PredictorConfig, store: Store, state: ObjectStore, app_name: str) -> None:
        self.config, self.store, self.state = config, store, state
        self.name = f"{app_name}-retrain"
        self._info: dict = {"retrains_submitted": 0, "retrain_running": False, "last_retrain": None}
        self._actor = None

    def _get(self):
        import ray

        if self._actor is None:
            remote = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1)(RetrainActor)
            self._actor = remote.options(name=self.name, namespace=NAMESPACE, get_if_exists=True).remote(
                self.config.model_dump(mode="json"), self.store, self.state)
        return self._actor

    def tick(self, spec) -> None:
        import ray

        try:
            self._info = ray.get(self._get().tick.remote(spec, self.config.retrain.model_dump(mode="json")),
                                 timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            self._actor = None  # its owner (another replica) is gone: the next tick creates it again
            raise

    def info(self) -> dict:
        return dict(self._info, retrain_coordinator=self.name)
