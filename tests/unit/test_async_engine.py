"""The async streaming interface on the fake runner."""

from __future__ import annotations

import asyncio

import pytest

from app.engine.async_engine import AsyncLLMEngine
from app.engine.engine import RequestRejected
from app.engine.request import EngineRequest, Prediction, SamplingParams
from tests.engine_helpers import make_engine


def request(n_prompt: int, max_tokens: int) -> dict:
    return dict(
        prompt_token_ids=[5] * n_prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        prediction=Prediction(bucket=0, bound_tokens=max_tokens),
    )


@pytest.fixture
def aengine():
    engine = AsyncLLMEngine(make_engine("paged", step_s=0.0))
    yield engine
    engine.shutdown()


async def collect(aengine, rid, **req):
    return [out async for out in aengine.generate(EngineRequest(request_id=rid, **req))]


async def test_concurrent_streams_each_get_their_tokens(aengine):
    results = await asyncio.gather(*(collect(aengine, f"r{i}", **request(5, 10 + i)) for i in range(4)))
    for i, outs in enumerate(results):
        assert len(outs) == 10 + i
        assert [o.num_output_tokens for o in outs] == list(range(1, 11 + i))
        assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert aengine.engine.pool.num_used_blocks == 0


async def test_abandoned_stream_aborts_and_frees_blocks(aengine):
    agen = aengine.generate(EngineRequest(request_id="x", **request(5, 80)))
    first = await agen.__anext__()
    assert first.num_output_tokens == 1
    await agen.aclose()  # what a client disconnect does to the stream
    for _ in range(100):
        if not aengine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not aengine.engine.has_unfinished_requests()
    assert aengine.engine.pool.num_used_blocks == 0


async def test_rejected_request_raises_to_the_caller(aengine):
    with pytest.raises(RequestRejected):
        await collect(aengine, "big", **request(200, 100))
    assert aengine.healthy


async def test_a_duplicate_id_is_refused_and_the_first_stream_keeps_its_tokens(aengine):
    first = aengine.generate(EngineRequest(request_id="dup", **request(5, 30)))
    assert (await first.__anext__()).num_output_tokens == 1
    with pytest.raises(ValueError, match="duplicate request id 'dup'"):
        await collect(aengine, "dup", **request(5, 3))
    async def drain():
        return [out async for out in first]

    rest = await asyncio.wait_for(drain(), timeout=30)  # before the fix the refused caller dropped this stream
    assert rest[-1].finished and rest[-1].num_output_tokens == 30
    assert aengine.engine.pool.num_used_blocks == 0


async def test_a_loop_that_stops_stepping_with_work_is_reported_stalled():
    """check_health's question: an engine loop alive but no step finished for ``stall_s`` while it
    has requests (a hung forward, a deadlock) is unhealthy; an idle loop never is, and a loop that
    resumes is healthy again."""
    import threading

    from app.engine.async_engine import EngineStalledError

    release = threading.Event()
    engine = make_engine("paged", step_s=0.0)
    inner = engine.runner.execute
    hang = {"on": False}

    def execute(out):
        if hang["on"]:
            release.wait(timeout=30)
        return inner(out)

    engine.runner.execute = execute
    aengine = AsyncLLMEngine(engine)
    try:
        await asyncio.sleep(0.3)
        aengine.check(stall_s=0.1)  # idle for 0.3 s: not stalled
        assert len(await collect(aengine, "a", **request(4, 3))) == 3
        hang["on"] = True
        task = asyncio.ensure_future(collect(aengine, "b", **request(4, 3)))
        await asyncio.sleep(0.4)
        with pytest.raises(EngineStalledError, match="no step finished"):
            aengine.check(stall_s=0.2)
        aengine.check(stall_s=5.0)  # within a longer limit
        hang["on"] = False
        release.set()
        assert len(await task) == 3
        aengine.check(stall_s=0.2)
    finally:
        release.set()
        aengine.shutdown()


def test_a_fault_file_makes_the_next_forward_raise_once(tmp_path):
    """``fault_dir`` (chaos testing): a file named ``forward_error`` there makes the engine's next
    step raise as a kernel or device fault would, and is used up, so a replacement replica that
    reads the same folder serves normally."""
    from app.engine.faults import InjectedFault

    engine = make_engine("paged", step_s=0.0, fault_dir=str(tmp_path))
    engine.add_request(EngineRequest(request_id="a", **request(4, 3)))
    assert engine.step()  # no file: a normal step
    (tmp_path / "forward_error").touch()
    with pytest.raises(InjectedFault, match="forward_error"):
        engine.step()
    assert not (tmp_path / "forward_error").exists()
    fresh = make_engine("paged", step_s=0.0, fault_dir=str(tmp_path))
    fresh.add_request(EngineRequest(request_id="b", **request(4, 3)))
    assert fresh.step()


async def test_a_crashed_loop_calls_on_crash_instead_of_failing_the_streams(tmp_path):
    """A replica passes ``on_crash`` to end its process when the loop dies (Serve then replaces it
    and the ingress resumes the open answers on the new replica): the streams are then left for the
    process's death to end, never sent an error that would end the answers early."""
    from app.engine.faults import InjectedFault

    crashed = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    engine = make_engine("paged", step_s=0.0, fault_dir=str(tmp_path))
    aengine = AsyncLLMEngine(engine, on_crash=lambda exc: loop.call_soon_threadsafe(crashed.set_result, exc))
    try:
        (tmp_path / "forward_error").touch()
        task = asyncio.ensure_future(collect(aengine, "a", **request(4, 3)))
        assert isinstance(await asyncio.wait_for(crashed, 5), InjectedFault)
        await asyncio.sleep(0.2)
        assert not task.done()  # no error delivered: the process's exit ends it
        assert not aengine.healthy
        task.cancel()
    finally:
        aengine.close()
