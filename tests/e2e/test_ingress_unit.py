"""The ingress's parts without a cluster (but with Ray Serve imported: the ingress module and its
error types): the predictor timeout fallback, the prediction-accuracy window, requeueing, the flex
gate. SSE and completion shapes and the app config need no Ray: tests/unit/test_chat_shapes.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import AppConfig
from app.engine.request import Prediction
from deployments.chat import ChatResult
from deployments.engine_server import PredictionWindow
from deployments.pool_gate import PoolGate
from predictor.buckets import LengthBuckets
from tests.fake_handles import Handle

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # imports Ray Serve, starts nothing


def _item(text: str, n: int, finished: bool = False, reason: str | None = None) -> dict:
    return {"text": text, "completion_tokens": n, "prompt_tokens": 7, "finished": finished, "finish_reason": reason}


class _SlowResponse:
    def __init__(self) -> None:
        self.cancelled = False

    def __await__(self):
        return asyncio.sleep(3600).__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _Metrics:
    def __init__(self) -> None:
        self.fallbacks: list[str] = []

    def fallback(self, tier: str) -> None:
        self.fallbacks.append(tier)


@pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")  # Serve's wrapper, never started
def test_a_slow_predictor_falls_back_to_max_and_is_counted():
    from deployments.ingress import Ingress

    response = _SlowResponse()
    ingress = object.__new__(Ingress.func_or_class)
    ingress.config = AppConfig.model_validate({"pools": {"online": {}, "offline": {}}, "predictor": {"timeout_ms": 20}})
    ingress.metrics, ingress.predictor_fallbacks = _Metrics(), 0
    assert asyncio.run(ingress._predict(response, "online")) is None
    assert response.cancelled and ingress.predictor_fallbacks == 1 and ingress.metrics.fallbacks == ["online"]


def test_prediction_window_counts_natural_finishes_only():
    window = PredictionWindow(LengthBuckets(max_tokens=100, num_buckets=10))
    assert window.rates() is None
    predicted = Prediction(bucket=0, bound_tokens=10)
    window.add(predicted, 8, "stop")  # right bucket, bound held
    window.add(predicted, 25, "stop")  # two buckets off, bound broken
    window.add(predicted, 100, "length")  # cut off: unknown true length, skipped
    window.add(None, 5, "stop")  # fallback: nothing predicted
    assert window.rates() == (0.5, 0.5)


class _Stream:
    """A streaming handle response: raises ``error`` at the first item, else yields ``items``."""

    def __init__(self, items: list[dict], error: Exception | None = None, fail_after: Exception | None = None) -> None:
        self.items, self.error, self.fail_after, self.cancelled = list(items), error, fail_after, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.error is not None:
            raise self.error
        if not self.items:
            raise self.fail_after or StopAsyncIteration()
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _Pool:
    """A pool handle whose successive calls return the given streams."""

    def __init__(self, streams: list[_Stream]) -> None:
        self.streams, self.calls, self.requests = list(streams), 0, []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, request: dict) -> _Stream:
        self.calls += 1
        self.requests.append(request)
        return self.streams.pop(0)


def _calls(pools: dict, gate: PoolGate | None, limits: dict | None = None, metrics=None):
    from deployments.pool_calls import PoolCalls

    config = AppConfig.model_validate({"pools": {"online": {}, "offline": {}}, "ingress": limits or {}})
    return PoolCalls(pools, config.ingress, gate, metrics)


def test_a_drained_replica_is_requeued_not_lost():
    """A replica removed by a scale-down (or dead) before the first token: the request goes to the
    pool again; after REQUEUE_ATTEMPTS losses the client gets a retryable 503."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from app.api import errors
    from deployments.engine_server import GenerateRequest
    from deployments.pool_calls import REQUEUE_ATTEMPTS

    lost = [_Stream([], ActorDiedError()), _Stream([], ActorUnavailableError("draining", None))]
    ok = _Stream([_item("hi", 1, True, "stop")])
    calls = _calls({"offline": _Pool([*lost, ok])}, PoolGate(lambda: {"offline": {"status": "HEALTHY", "RUNNING": 1}}, "offline"))
    stream, first = asyncio.run(calls.start(GenerateRequest(), "offline"))
    assert stream is ok and first["text"] == "hi" and calls.pools["offline"].calls == 3
    assert all(s.cancelled for s in lost)
    calls.pools["offline"] = _Pool([_Stream([], ActorDiedError()) for _ in range(REQUEUE_ATTEMPTS)])
    with pytest.raises(errors.APIError) as err:
        asyncio.run(calls.start(GenerateRequest(), "offline"))
    assert err.value.status_code == 503


def test_flex_waits_while_the_offline_pool_is_at_zero():
    """Nothing reaches the offline handle (where Serve's cold-start rule would wake the pool) until
    the autoscaler has the pool up again; meanwhile the call is counted as held."""
    from app.engine.request import SamplingParams
    from deployments.engine_server import GenerateRequest

    states = {"offline": {"status": "DOWNSCALING", "STOPPING": 1}}
    calls = _calls({"offline": _Pool([_Stream([_item("hi", 1, True, "stop")])])},
                   PoolGate(lambda: states, "offline", poll_s=0.01))
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=SamplingParams(max_tokens=40))

    async def scenario():
        call = asyncio.ensure_future(calls.start(request, "offline"))
        await asyncio.sleep(0.1)
        assert calls.pools["offline"].calls == 0 and not call.done()
        assert calls.offline_gate.stats() == {"held_requests": 1.0, "held_tokens": 43.0}  # the ingress's autoscaling stats
        states["offline"] = {"status": "UPSCALING", "STARTING": 1}
        _, first = await asyncio.wait_for(call, 30)  # a hang guard, not a speed claim
        assert first["text"] == "hi" and calls.pools["offline"].calls == 1
        assert calls.offline_gate.stats()["held_requests"] == 0.0

    asyncio.run(scenario())


def test_flex_past_the_held_limit_gets_a_429_with_retry_after():
    from app.api import errors
    from app.engine.request import SamplingParams
    from deployments.engine_server import GenerateRequest

    gate = PoolGate(lambda: {"offline": {"status": "HEALTHY"}}, "offline", poll_s=0.01)  # at zero
    gate.held_requests = 1  # one call already waits
    calls = _calls({"offline": _Pool([])}, gate, {"flex_max_held": 1})
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=SamplingParams(max_tokens=40))
    with pytest.raises(errors.APIError) as err:
        asyncio.run(calls.start(request, "offline"))
    assert err.value.status_code == 429 and err.value.headers == {"Retry-After": "2"}
    assert calls.pools["offline"].calls == 0 and gate.held_requests == 1
    # a resumed answer (or a requeue) already holds its slot: it waits its turn, it is not refused
    calls.limits.flex_max_wait_s = 0.05
    calls.pools["offline"] = _Pool([_Stream([_item("hi", 1, True, "stop")])])
    _, first = asyncio.run(calls.start(request, "offline", new=False))
    assert first["text"] == "hi" and calls.pools["offline"].calls == 1


def _token_item(text: str, n: int, token: int, finished: bool = False) -> dict:
    return {**_item(text, n, finished, "length" if finished else None), "token_ids": [token]}


@pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")
def test_an_answer_whose_replica_is_lost_mid_stream_resumes_on_another():
    """The stream goes on where it stopped: the next replica gets the tokens so far and how much text
    the client has; the client sees every character once and usage counts all tokens."""
    from ray.exceptions import ActorDiedError

    from app.engine.request import SamplingParams
    from deployments.engine_server import GenerateRequest
    from deployments.ingress import Ingress

    class Metrics:
        resumes = 0

        def resumed(self, tier: str) -> None:
            Metrics.resumes += 1

        def finished(self, *_) -> None:
            pass

    ingress = object.__new__(Ingress.func_or_class)
    ingress.metrics = Metrics()
    broken = _Stream([_token_item("Hel", 1, 11), _token_item("lo", 2, 12)], fail_after=ActorDiedError())
    rest = _Stream([_token_item(" wor", 3, 13), _token_item("ld", 4, 14, finished=True)])
    ingress.calls = _calls({"online": _Pool([rest])}, None, metrics=ingress.metrics)
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=SamplingParams(max_tokens=4))

    async def go():
        first = await broken.__anext__()
        result = ChatResult(request.request_id, "m", "online", 0.0, first)
        events = [e async for e in ingress._stream_events(ingress.calls.answer(request, "online", broken, result), result, True)]
        return result, events

    result, events = asyncio.run(go())
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n" and not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello world"
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and result.token_ids == [11, 12, 13, 14]
    resumed = ingress.calls.pools["online"].requests[0]
    assert resumed["resume_output_token_ids"] == [11, 12] and resumed["resume_emitted_chars"] == 5
    assert resumed["prompt_token_ids"] == [1, 2, 3] and resumed["request_id"] == request.request_id
    assert broken.cancelled and not rest.cancelled and Metrics.resumes == 1


@pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")  # Serve's wrapper, never started
@pytest.mark.parametrize(("predictor_info", "problems"), [
    ({"version": "3", "unavailable": None}, []),
    ({"version": "max-fallback", "unavailable": "champion: RegistryError: no champion version of length-predictor in "
      "sqlite:////n2/mlflow/mlflow.db"}, ["predictor serves max reservation: champion: RegistryError: no champion version "
                                          "of length-predictor in sqlite:////n2/mlflow/mlflow.db"]),
    (TimeoutError(), ["predictor: TimeoutError"]),
])
def test_health_is_degraded_while_the_predictor_serves_without_its_champion(predictor_info, problems):
    from deployments.ingress import Ingress

    ingress = object.__new__(Ingress.func_or_class)
    stats = {"num_running": 0, "num_waiting": 0, "kv_free_tokens": 100}
    ingress.pools = {"online": Handle(stats=stats), "offline": Handle(stats=RuntimeError("replica died"))}
    ingress.predictor = Handle(info=predictor_info)
    ingress._replica_states = lambda: {"online": {"RUNNING": 1}, "offline": {"RUNNING": 1}}
    ingress.model_id, ingress.predictor_fallbacks = "m", 0
    ingress.offline_gate = type("Gate", (), {"held_requests": 0})()
    health = json.loads(asyncio.run(ingress.health()).body)
    assert health["status"] == "degraded" and health["problems"] == ["pool offline: RuntimeError", *problems]
    ingress.pools["offline"] = Handle(stats=stats)
    health = json.loads(asyncio.run(ingress.health()).body)
    assert health["status"] == ("degraded" if problems else "ok") and health["problems"] == problems


@pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")
def test_a_stream_whose_body_is_never_read_still_cancels_the_engine_request():
    """The client goes away between the engine's first item and the first byte: Starlette drops the
    response without starting its body, and a generator never started runs no ``finally``. The
    engine's request must be cancelled anyway; a body read to its end cancels nothing."""
    import gc

    from app.engine.request import SamplingParams
    from deployments.engine_server import GenerateRequest
    from deployments.ingress import Ingress

    ingress = object.__new__(Ingress.func_or_class)
    ingress.calls = _calls({}, None)
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=SamplingParams(max_tokens=2))

    def events_of(stream: _Stream):
        first = asyncio.run(stream.__anext__())
        result = ChatResult(request.request_id, "m", "online", 0.0, first)
        return ingress._sse(request, "online", stream, result, False)

    dropped = _Stream([_token_item("Hi", 1, 11), _token_item("!", 2, 12, finished=True)])
    events = events_of(dropped)
    del events
    gc.collect()
    assert dropped.cancelled

    read = _Stream([_token_item("Hi", 1, 11), _token_item("!", 2, 12, finished=True)])
    events = events_of(read)

    async def drain(it):
        return [e async for e in it]

    assert asyncio.run(drain(events))[-1] == "data: [DONE]\n\n"
    del events
    gc.collect()
    assert not read.cancelled


@pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")
def test_an_unexpected_failure_mid_stream_tells_the_client_no_internals():
    """A failure that is not a lost replica (a replica's exception, which Ray wraps with its
    traceback, pids and actor ids) ends the stream with a 503 error chunk and [DONE]; the chunk
    names the failure's type only: no traceback, path or process details reach the client."""
    from app.engine.request import SamplingParams
    from deployments.engine_server import GenerateRequest
    from deployments.ingress import Ingress

    class Metrics:
        def resumed(self, tier: str) -> None:
            pass

    internals = RuntimeError('ray::ServeReplica:foreserve:online (pid=1, ip=10.0.0.1)\nTraceback (most recent call '
                             'last):\n  File "/work/main/app/engine/engine.py", line 1, in step')
    ingress = object.__new__(Ingress.func_or_class)
    ingress.metrics = Metrics()
    ingress.calls = _calls({}, None, metrics=ingress.metrics)
    broken = _Stream([_token_item("Hel", 1, 11)], fail_after=internals)
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=SamplingParams(max_tokens=4))

    async def go():
        first = await broken.__anext__()
        result = ChatResult(request.request_id, "m", "online", 0.0, first)
        return [e async for e in ingress._stream_events(ingress.calls.answer(request, "online", broken, result), result, True)]

    events = asyncio.run(go())
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "service_unavailable" and "RuntimeError" in error["message"]
    assert not any(leak in events[-2] for leak in ("Traceback", "pid=", "/work/", "File "))


def test_an_engine_shedding_load_is_a_429_with_retry_after():
    """A pool past its ``max_queue_delay_ms`` refuses a new request with a 429 item: the client gets
    OpenAI's rate-limit error with Retry-After before any byte, not a 400 or a 500."""
    from app.api import errors
    from deployments.engine_server import GenerateRequest

    for why in ("this request's first token is about 4.6 s away, 4.2 s of it for others ahead (alone it takes 0.4 s), "
                "past this pool's max_queue_delay_ms (4000)",
                "it waited 3.9 s without starting for others ahead (alone its prompt takes 0.2 s), and its first token "
                "can no longer come within this pool's max_queue_delay_ms (4000)"):
        shed = _Stream([{"request_id": "r", "error": {"status_code": 429, "message": why}}])
        calls = _calls({"online": _Pool([shed])}, None, {"retry_after_s": 3})
        with pytest.raises(errors.APIError) as refused:
            asyncio.run(calls.start(GenerateRequest(prompt_token_ids=[1]), "online"))
        assert refused.value.status_code == 429 and refused.value.headers == {"Retry-After": "3"}
        error = refused.value.body()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        # the engine's reason, so that a client (and foreserve chaos) tells a refusal at the door from
        # one of a request that waited its whole limit
        assert error["message"] == f"The online pool is too busy to answer in time: {why}; retry after 3 s.", error


def test_serve_status_is_asked_by_one_thread_at_a_time(monkeypatch: pytest.MonkeyPatch):
    """Ray Serve's ``serve.status()`` is not thread-safe: each call registers the autoscaling policy's
    module with cloudpickle and unregisters it after, so a second thread's unregister raises
    ``ValueError: ... is not registered for pickle by value``. The ingress asks it from threads
    (health and the flex gate), a burst watcher beside its waits: foreserve's calls take turns."""
    import threading
    import time
    from types import SimpleNamespace

    from ray import serve

    from deployments.pool_gate import replica_states

    inside, most = [0], [0]
    guard = threading.Lock()

    def status():
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with guard:
            inside[0] -= 1
        return SimpleNamespace(applications={})

    monkeypatch.setattr(serve, "status", status)
    threads = [threading.Thread(target=replica_states, args=("foreserve", ["offline"])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
