"""The real runner an ``EngineConfig`` asks for, and the size of its KV pool."""

from __future__ import annotations

from app.config import EngineConfig
from app.engine.runner import Runner
from app.heap import release_free_heap


def build_runner(config: EngineConfig) -> tuple[Runner, int]:
    """The runner for ``config`` (tensor-parallel when configured) and its KV pool's size in blocks;
    the heap pages its loading freed go back to the OS (``app/heap.py``)."""
    from app.engine.model.hf_runner import HFRunner
    from app.engine.model.arch import arch_config
    from app.engine.model.setup import on_short_lived_thread

    num_blocks = config.kv_pool_blocks(HFRunner.kv_bytes_per_token(arch_config(config.model_path)[1], config.cache_dtype))
    if config.tensor_parallel_size > 1 and config.use_ray_tp_workers():
        from app.engine.parallel.ray_ranks import RayTPRunner

        return RayTPRunner(config, num_blocks), num_blocks
    if config.tensor_parallel_size > 1:
        from app.engine.parallel.tp import TPRunner

        return TPRunner(config, num_blocks), num_blocks  # its ranks are processes of their own
    runner = on_short_lived_thread(lambda: HFRunner(config, num_blocks))  # see its docstring
    release_free_heap()
    return runner, num_blocks
