"""RayTPRunner: a replica's tensor-parallel ranks as Ray actors (DeepSpeed AutoTP inside each).

Inside Ray (a Serve replica, a Ray Data actor) the ranks are Ray actors, so Ray places and
accounts for them: each goes into its own bundle of the replica's placement group (Serve's
``placement_group_bundles``: bundle 0 for the replica, one per rank after it; on GPUs give each
rank bundle ``GPU: 1`` and Ray sets the rank's CUDA_VISIBLE_DEVICES). The ranks share the
replica's node (one shared-memory all-reduce): the group's strategy must be ``STRICT_PACK``, else
the runner refuses at once, and every rank's node is checked when it starts. Without a placement
group the ranks take no Ray resources and are pinned to the replica's node. Every step, the driver puts the ``SchedulerOutput`` in the
object store once and every rank runs its shard; rank 0 samples. Same contract as ``TPRunner``
(the process-based group used outside Ray) and the same rank code (``tp.build_rank_runner``).
"""

from __future__ import annotations

import os
import time

from app.config import EngineConfig
from app.engine.outputs import ModelRunnerOutput, SchedulerOutput
from app.engine.runner import Runner
from app.ports import free_port
from app.runtime_env import PROCESS_ENV, env_vars
from app.engine.parallel.tp import STARTUP_TIMEOUT_S, TPGroupError, build_rank_runner, rank_env, setup_driver


class RankWorker:
    """One TP rank (wrapped with ``ray.remote`` by the driver)."""

    def __init__(self, rank: int, world: int, config: EngineConfig, num_blocks: int, master_port: int) -> None:
        self.rank = rank
        self.runner = build_rank_runner(rank, world, config, num_blocks, master_port)

    def info(self) -> dict:
        import ray

        return {"num_heads": self.runner.num_heads, "num_kv_heads": self.runner.num_kv_heads, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def execute(self, scheduler_output: SchedulerOutput) -> list[int] | None:
        out = self.runner.execute(scheduler_output, sample=self.rank == 0)
        return out.sampled_token_ids if self.rank == 0 else None


def check_strategy(strategy: str, world: int) -> None:
    """Ranks of one replica must share its node: refuse a placement group that may spread them."""
    if strategy != "STRICT_PACK":
        raise ValueError(f"tensor_parallel_size {world} needs every rank on the replica's node, but its placement group's "
                         f"strategy is {strategy}: set the pool's placement_group_strategy to STRICT_PACK")


class RayTPRunner(Runner):
    """``RayTPRunner(config, num_blocks)``, ``execute``, ``shutdown`` (call from inside Ray)."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        if pg is not None:  # NOTE: before anything starts: a spread group would hang the ranks' rendezvous
            check_strategy(ray.util.placement_group_table(pg)["strategy"], config.tensor_parallel_size)
        world, threads = setup_driver(self, config, num_blocks)
        node_id = ray.get_runtime_context().get_node_id()
        first = 0
        if pg is not None:
            first = len(pg.bundle_specs) - world  # the replica's own bundle (if any) comes first
            if first < 0:
                raise ValueError(f"the placement group has {len(pg.bundle_specs)} bundles; tensor_parallel_size {world} needs one per rank")
        self.master_addr, self.master_port = master_addr, port = ray.util.get_node_ip_address(), free_port()
        base_env = env_vars(PROCESS_ENV)  # NOTE: an actor's runtime_env replaces its parent's env_vars
        worker = ray.remote(RankWorker)
        self._actors = []
        for rank in range(world):
            options: dict = {"max_restarts": 0}
            gpus = 0.0
            if pg is not None:
                bundle = pg.bundle_specs[first + rank]
                gpus = bundle.get("GPU", 0)
                options.update(num_cpus=bundle.get("CPU", 0), num_gpus=gpus,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + rank))
            else:
                options.update(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            # NOTE: a rank given its GPU by Ray sees that one only (CUDA_VISIBLE_DEVICES): it is its device 0
            env = rank_env(rank, world, master_addr, port, threads, local_rank=0 if gpus else None)
            options["runtime_env"] = {"env_vars": {**base_env, **env}}
            self._actors.append(worker.options(**options).remote(rank, world, self.config, num_blocks, port))
        try:
            self.rank_info = self._gather([a.info.remote() for a in self._actors], STARTUP_TIMEOUT_S)
            if elsewhere := [r for r, info in enumerate(self.rank_info) if info["node_id"] != node_id]:
                raise TPGroupError(f"tensor-parallel ranks {elsewhere} started on another node than the replica's")
        except BaseException:
            self.shutdown()
            raise

    def _gather(self, refs: list, timeout_s: float | None = None) -> list:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(refs, timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            self.broken = True
            self.shutdown()
            raise TPGroupError(f"tensor-parallel group failed: {exc}") from exc
        # A rank's own exception (e.g. a bad chunk) comes back as itself: the group stays usable.

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        import ray

        t0 = time.perf_counter()
        if self.broken:
            raise TPGroupError("the tensor-parallel group was shut down after an earlier failure")
        ref = ray.put(scheduler_output)
        replies = self._gather([a.execute.remote(ref) for a in self._actors])
        return ModelRunnerOutput(sampled_token_ids=replies[0], step_s=time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Kill the rank actors (idempotent)."""
        import ray

        for actor in getattr(self, "_actors", []):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []
