"""A batch job's generation actors and how the driver keeps them busy and bounded.

``start_workers`` starts the ``EngineStage`` actors (or one ``ServeStage``) with bounded restarts;
``generate`` hands each the next batch as it finishes one, sends a batch again while its actor is
being restarted on another node, and lets ``StartDeadline`` fail the job when an actor cannot be
placed or loaded in time. ``foreserve/batch/job.py`` drives them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from app.config import EngineConfig
from foreserve.batch.stages import EngineStage, ServeStage

logger = logging.getLogger(__name__)
MAX_RESTARTS = 3  # a job's actor is restarted this many times (its running batch retried as often), then the job fails
START_TIMEOUT_S = 300.0  # an actor not up this long after its start or restart fails the job
POLL_S = 5.0  # how often the driver checks on actors while batches run
RESUBMIT_PAUSE_S = 1.0  # a batch whose actor is restarting goes again after this pause
WAITING = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "RESTARTING")  # Ray's states of an actor not up yet


def engine_resources(engine: EngineConfig, engine_cpus: float, cluster_gpus: float) -> dict[str, float]:
    """Ray resources of one engine actor: ``engine_cpus`` per rank, and its GPU when the engine runs
    on CUDA (``device`` cuda, or auto on a cluster with GPUs), so that Ray places it on a GPU node
    and hands it that GPU."""
    on_gpu = engine.device.startswith("cuda") or (engine.device == "auto" and cluster_gpus > 0)
    if on_gpu and engine.tensor_parallel_size > 1:
        raise ValueError("a batch engine with tensor_parallel_size > 1 on GPUs needs its ranks in a placement group, "
                         "which batch jobs do not make yet: use --backend serve (the offline pool's placement group) "
                         "or tensor_parallel_size 1")
    return {"num_cpus": engine_cpus * engine.tensor_parallel_size, "num_gpus": 1.0 if on_gpu else 0.0}


@dataclass
class Worker:
    """One of the job's generation actors, the name the job's errors give it and the Ray resources it needs."""

    actor: object
    name: str
    needs: dict[str, float]


def start_workers(backend: str, count: int, engine: EngineConfig, out: str, engine_cpus: float, app_name: str,
                  node_resources: dict[str, float] | None = None) -> list[Worker]:
    """The job's generation actors: ``EngineStage`` (an engine each; ``node_resources``: custom Ray
    resources each also needs, e.g. ``{"gpu_node": 0.01}`` to keep them on nodes that offer it) or
    one ``ServeStage``.

    Plain Ray actors, restarted up to ``MAX_RESTARTS`` times when they die, with their running batch
    retried as often (``run`` skips the rows the batch already stored). Not a Ray Data stage: once
    the rows are predicted, nothing of Ray Data's executor polls beside the engines."""
    import ray

    stage = {"engine": engine.model_dump(mode="json"), "out": out}
    bounded = {"max_restarts": MAX_RESTARTS, "max_task_retries": MAX_RESTARTS}
    if backend == "serve":
        actor = ray.remote(ServeStage).options(num_cpus=0.05, **bounded)
        return [Worker(actor.remote(**stage, app_name=app_name), "the serve stage actor", {"CPU": 0.05})]
    resources = engine_resources(engine, engine_cpus, ray.cluster_resources().get("GPU", 0.0))
    custom = dict(node_resources or {})
    actor = ray.remote(EngineStage).options(**resources, resources=custom, **bounded)
    needs = {"CPU": resources["num_cpus"], **({"GPU": resources["num_gpus"]} if resources["num_gpus"] else {}), **custom}
    return [Worker(actor.remote(**stage), f"engine actor {i + 1} of {count}", needs) for i in range(count)]


def actor_state(actor) -> str | None:
    """The actor's state in Ray's GCS (``ALIVE``, ``PENDING_CREATION``, ``RESTARTING``, ``DEAD``...);
    None when it cannot be read (a Ray internal: then no deadline applies)."""
    try:
        from ray._private import state

        return state.actors(actor_id=actor._actor_id.hex()).get("State")
    except Exception:  # noqa: BLE001
        return None


class StartDeadline:
    """Fails the job when a worker is not up (placed and its ``__init__`` done) ``timeout_s`` after
    its start or its latest restart."""

    def __init__(self, workers: list[Worker], timeout_s: float, started: float) -> None:
        self.timeout_s = timeout_s
        self.since = {w.name: started for w in workers}  # workers not seen up yet, since when

    def check(self, workers: list[Worker]) -> None:
        now = time.monotonic()
        for w in workers:
            state = actor_state(w.actor)
            if state not in WAITING:
                self.since.pop(w.name, None)
                continue
            waited = now - self.since.setdefault(w.name, now)
            if waited > self.timeout_s:
                how = "restarted after it died" if state == "RESTARTING" else "started"
                raise RuntimeError(
                    f"{w.name} was {how} {waited:.0f} s ago and is not up (Ray state {state}): it needs {w.needs}, "
                    f"and no live node can take it or its engine did not load in time (--start-timeout "
                    f"{self.timeout_s:.0f}); the cluster's resources: {_resources()}")


def _resources() -> dict[str, float] | str:
    try:
        import ray

        return {k: v for k, v in sorted(ray.cluster_resources().items()) if not k.startswith(("node:", "memory", "object_store"))}
    except Exception:  # noqa: BLE001 - only a hint in an error message
        return "unknown"


def generate(workers: list[Worker], batches: list[list[dict]], on_done, run_id: str,
             deadline: StartDeadline | None = None) -> None:
    """Each worker takes the next batch as soon as it finishes one, batch ``i`` storing its rows
    under ``parts/<run_id>-<i>/``; ``on_done(rows)`` per batch. Every ``POLL_S`` without a batch
    done, ``deadline`` checks the workers (one that cannot be placed again fails the job)."""
    import ray
    from ray.exceptions import RayActorError

    queue = [(f"{run_id}-{i:06d}", batch) for i, batch in enumerate(batches)][::-1]
    running = {}
    for w in workers:
        if queue:
            key, batch = queue.pop()
            running[w.actor.run.remote(batch, key)] = (w, key, batch)
    while running:
        done, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
        if not done:
            if deadline is not None:
                deadline.check([w for w, _, _ in running.values()])
            continue
        worker, key, batch = running.pop(done[0])
        try:
            on_done(ray.get(done[0]))
        except RayActorError as exc:
            state = actor_state(worker.actor)
            if state == "DEAD":
                raise RuntimeError(f"{worker.name} is gone for good (Ray restarts a job's actor {MAX_RESTARTS} times "
                                   f"at most): {exc}") from exc
            # NOTE: its node died and Ray is placing it again (Ray's own task retries can all be
            # spent while it restarts); the batch goes again, skipping the rows it stored, and the
            # deadline bounds how long the restart may take
            logger.warning("%s is %s after %s; its batch %s goes again", worker.name, state, type(exc).__name__, key)
            time.sleep(RESUBMIT_PAUSE_S)
            running[worker.actor.run.remote(batch, key)] = (worker, key, batch)
            continue
        if queue:
            key, batch = queue.pop()
            running[worker.actor.run.remote(batch, key)] = (worker, key, batch)
