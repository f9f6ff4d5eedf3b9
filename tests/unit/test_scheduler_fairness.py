"""Who yields and who waits: the preemption victim, offline anti-starvation, and admission
under reserve_predicted's timeline (fake runner)."""

from __future__ import annotations

import pytest

from tests.engine_helpers import add, make_engine, run_all


def test_the_lowest_priority_decode_yields_itself_not_a_prefill_ahead_of_it():
    """Decodes are scheduled before prefill chunks; when the last-in-line decode runs the pool dry,
    it must not evict a higher-priority request that is still prefilling (the documented rule:
    the lowest-priority sequence yields)."""
    engine = make_engine("paged", "fcfs", kv_tokens=64, max_num_batched_tokens=8)  # 4 blocks, chunked prefill
    low = add(engine, "low", 8, 40, priority=0)
    for _ in range(4):
        engine.step()
    high = add(engine, "high", 40, 2, priority=5)  # 3 blocks once prefilled, in chunks of <= 8 tokens
    run_all(engine)
    assert (low.num_output_tokens, high.num_output_tokens) == (40, 2)
    assert high.num_preemptions == 0 and low.num_preemptions >= 1
    assert high.finished_s < low.finished_s


@pytest.mark.parametrize("max_overtakes", [8, 10**9])
def test_offline_packing_cannot_starve_a_large_request(max_overtakes):
    """Decreasing first-fit skips a request that does not fit and fills the hole with smaller ones;
    under a steady stream of small ones the large one would never fit. After max_overtakes such
    passes the queue waits for it."""
    engine = make_engine("reserve_predicted", "offline", kv_tokens=32, max_overtakes=max_overtakes)
    add(engine, "s0", 4, 2, predicted=2)
    engine.step()
    long = add(engine, "long", 28, 4, predicted=4)  # both blocks: never fits beside a short one
    done_at = None
    for step in range(1, 200):
        add(engine, f"s{step}", 4, 2, predicted=2)
        if any(out.request_id == "long" and out.finished for out in engine.step()):
            done_at = step
            break
    if max_overtakes == 8:
        assert done_at is not None and long.num_overtaken == 8 and done_at < 8 * 3 + 10
    else:
        assert done_at is None and long.num_overtaken > 50  # what the bound prevents


@pytest.mark.parametrize("scheduler", ["fcfs", "offline"])
def test_reserve_predicted_admits_as_soon_as_the_timeline_has_room(scheduler):
    """The timeline promises memory a running sequence will have released by the time the newcomer
    needs it; that room opens as steps pass, with no block freed. An admission attempt that failed
    must not be cached as fruitless until the pool changes."""
    engine = make_engine("reserve_predicted", scheduler, kv_tokens=64)  # 4 blocks of 16
    a = add(engine, "a", 33, 15, predicted=15)  # 3 blocks from its prefill to its end (step ~15)
    engine.step()
    b = add(engine, "b", 4, 40, predicted=40)  # 1 block for 12 steps, then more: fits once a ends within 12
    for _ in range(4):  # its first attempt fails; two steps later the timeline has room, no block freed
        engine.step()
    assert b.admitted_s is not None and a.finished_s is None  # before the fix: only once a finished
    run_all(engine)
    assert engine.stats().preemptions == 0
