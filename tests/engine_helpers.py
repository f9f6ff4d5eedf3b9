"""Build engines on the fake runner and run them to completion."""

from __future__ import annotations

from app.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.clock import ModelledClock
from app.engine.request import EngineRequest, Prediction, SamplingParams
from app.engine.sim.replay import ReplayRunner
from tests.fake_runner import FakeRunner


def make_engine(
    allocation: str = "reserve_predicted",
    scheduler: str = "fcfs",
    kv_tokens: int = 256,
    block: int = 16,
    eos_at: dict[str, int] | None = None,
    step_s: float = 0.01,
    **overrides,
) -> LLMEngine:
    fields = dict(
        allocation=allocation,
        scheduler=scheduler,
        kv_cache_tokens=kv_tokens,
        block_size_tokens=block,
        max_model_len_tokens=2048,
        default_max_tokens=100,
        max_num_batched_tokens=64,
    )
    fields.update(overrides)
    config = EngineConfig(**fields)
    runner = ReplayRunner(FakeRunner(block, step_s=step_s, eos_at=eos_at))
    return LLMEngine(config, runner, config.kv_pool_blocks(1), clock=ModelledClock())


def add(
    engine: LLMEngine,
    rid: str,
    prompt_tokens: int,
    output_tokens: int,
    predicted: int | None = None,
    max_tokens: int | None = None,
    priority: int = 0,
    ignore_eos: bool = True,
    rank: float | None = None,
):
    """A request that ends at ``output_tokens`` with a predicted bound (and, given ``rank``, a
    ranking estimate to order by). Below ``max_tokens`` the end is an EOS at that length: replayed
    (the fake model's own EOS suppressed before it) when ``ignore_eos``, else the fake model's EOS
    (its ``eos_at``, if earlier) or one placed there."""
    max_tokens = max_tokens or output_tokens
    if output_tokens < max_tokens and ignore_eos:
        engine.runner.lengths[rid] = output_tokens
        ignore_eos = False
    elif output_tokens < max_tokens:
        eos_at = engine.runner.eos_at
        eos_at[rid] = min(eos_at.get(rid, output_tokens), output_tokens)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    bound = predicted if predicted is not None else sampling.max_tokens
    return engine.add_request(EngineRequest(
        prompt_token_ids=[5] * prompt_tokens,
        sampling=sampling,
        request_id=rid,
        priority=priority,
        prediction=Prediction(bucket=engine.buckets.bucket_of(bound), bound_tokens=bound, rank_tokens=rank,
                              exact_tokens=output_tokens),
    ))


def run_all(engine: LLMEngine, max_steps: int = 100_000, on_step=None) -> dict[str, list]:
    """Step until done; return request_id -> list of RequestOutput. Checks the pool after every step."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        pool = engine.pool
        assert 0 <= pool.num_free_blocks <= pool.num_blocks
        assert pool.used_tokens <= pool.capacity_tokens
        if on_step:
            on_step(engine)
    else:
        raise AssertionError("engine did not finish")
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "blocks leaked after all requests finished"
    return outputs


def replay_arrivals(engine: LLMEngine, arrivals: list[tuple[float, str, int, int]]) -> tuple[dict[str, list], dict[str, str]]:
    """Open-loop arrivals on the engine's modelled clock: ``(time, request id, prompt tokens, output
    tokens)`` in time order, each added once the clock reaches it (idling to it when nothing runs).
    Returns each answered request's outputs and each refused one's reason (at admission: the
    ``EngineOverloaded`` message; later: the 429 output's error)."""
    from app.engine.shedding import EngineOverloaded

    outputs: dict[str, list] = {}
    refused: dict[str, str] = {}
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and pending:
            engine.clock.idle_until(pending[0][0])
        while pending and pending[0][0] <= engine.clock():
            _, rid, prompt, output = pending.pop(0)
            try:
                add(engine, rid, prompt, output, predicted=output)
            except EngineOverloaded as exc:
                refused[rid] = str(exc)
        for out in engine.step():
            if out.error is not None:
                refused[out.request_id] = out.error
            else:
                outputs.setdefault(out.request_id, []).append(out)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "blocks leaked after all requests finished"
    return outputs, refused
