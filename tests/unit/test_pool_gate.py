"""The offline pool's gate at the ingress: calls wait while the autoscaler has the pool at zero."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.pool_gate import GateFull, PoolGate, pool_is_up


@pytest.mark.parametrize("state, up", [
    ({"status": "HEALTHY", "RUNNING": 1}, True),
    ({"status": "UPSCALING", "STARTING": 1}, True),
    ({"status": "UPSCALING"}, True),  # the autoscaler decided to grow: a queued call wakes nothing it did not want
    ({"status": "UPDATING"}, True),  # being deployed
    ({"status": "DOWNSCALING", "STOPPING": 1}, False),  # yielding: its last replica drains
    ({"status": "HEALTHY"}, False),  # at zero
    ({}, True),  # unknown pool: let Serve decide
    (None, True),
])
def test_pool_is_up(state, up):
    assert pool_is_up(state) is up


HANG_GUARD_S = 30  # only so a broken gate fails instead of hanging; never a speed claim


def test_calls_wait_while_the_pool_is_at_zero_and_are_counted():
    states = {"offline": {"status": "HEALTHY"}}
    calls: list[float] = []
    poll_s = 0.02

    def read():
        calls.append(time.monotonic())
        return states

    async def scenario():
        gate = PoolGate(read, "offline", poll_s=poll_s)
        tokens = [100, 250, 1, 2, 3, 4, 5, 6, 7, 8]
        waiters = [asyncio.ensure_future(gate.wait(n)) for n in tokens]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiters)
        assert gate.stats() == {"held_requests": 10.0, "held_tokens": float(sum(tokens))}
        states["offline"] = {"status": "UPSCALING", "STARTING": 1}
        held = await asyncio.wait_for(asyncio.gather(*waiters), HANG_GUARD_S)
        assert all(h >= 0.1 for h in held)  # none left before the pool came up
        assert gate.stats() == {"held_requests": 0.0, "held_tokens": 0.0}
        assert await gate.wait(10) == 0.0  # open: no wait, nothing held

    asyncio.run(scenario())
    # one controller call per poll, however many calls wait: successive calls are at least poll_s apart
    # (ten waiters each asking on their own would make ten calls a poll)
    assert len(calls) >= 2
    assert all(b - a >= poll_s for a, b in zip(calls, calls[1:]))


def test_a_call_goes_anyway_after_max_wait_and_when_the_controller_fails():
    async def scenario():
        gate = PoolGate(lambda: {"offline": {"status": "HEALTHY"}}, "offline", poll_s=0.01)
        # the pool never comes up: the call goes once it has waited max_wait_s (the guard only catches a hang)
        held = await asyncio.wait_for(gate.wait(5, max_wait_s=0.05), HANG_GUARD_S)
        assert held >= 0.05 and not await gate.is_open()
        assert gate.held_requests == 0 and gate.held_tokens == 0

        def broken():
            raise ConnectionError("controller gone")

        assert await PoolGate(broken, "offline", poll_s=0.01).wait(5) == 0.0

    asyncio.run(scenario())


def test_a_call_past_max_held_is_refused_not_held():
    states = {"offline": {"status": "HEALTHY"}}

    async def scenario():
        gate = PoolGate(lambda: states, "offline", poll_s=0.02)
        held = [asyncio.ensure_future(gate.wait(10, max_held=2)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(GateFull):
            await gate.wait(10, max_held=2)
        assert gate.stats() == {"held_requests": 2.0, "held_tokens": 20.0}  # the refused call left no trace
        states["offline"] = {"status": "HEALTHY", "RUNNING": 1}
        await asyncio.wait_for(asyncio.gather(*held), HANG_GUARD_S)
        assert await gate.wait(10, max_held=0) == 0.0  # an open pool holds nothing, so no limit applies

    asyncio.run(scenario())


def test_closing_the_gate_refuses_the_held_calls_and_new_ones():
    """A draining ingress closes its gate: calls held for a pool at zero are refused at once
    (``GateClosed``: the client gets a 503 to retry), not kept until the process ends."""
    from deployments.pool_gate import GateClosed

    states = {"offline": {"status": "HEALTHY"}}

    async def scenario():
        gate = PoolGate(lambda: states, "offline", poll_s=0.02)
        held = asyncio.ensure_future(gate.wait(10))
        await asyncio.sleep(0.05)
        gate.close()
        with pytest.raises(GateClosed):
            await asyncio.wait_for(held, HANG_GUARD_S)
        with pytest.raises(GateClosed):
            await asyncio.wait_for(gate.wait(10), HANG_GUARD_S)
        assert gate.stats() == {"held_requests": 0.0, "held_tokens": 0.0}

    asyncio.run(scenario())
