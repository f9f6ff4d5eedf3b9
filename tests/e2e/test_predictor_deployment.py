"""The shared predictor deployment: champion hot swap without Ray, then batched calls on real Ray Serve."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from app import paths
from deployments.predictor import LengthPredictorServer
from predictor import registry
from predictor.base import NO_BOUND
from predictor.training.pipeline import train_and_register
from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

pytestmark = [pytest.mark.ray, pytest.mark.mlflow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_fallback_then_hot_swap_to_each_new_champion(home: Path):
    server = LengthPredictorServer({"poll_s": 3600})  # polled by hand below
    try:
        assert server.version == "max-fallback" and "no champion" in server.unavailable  # /health: degraded
        fallback = server.predict_batch(["hi"])[0]
        assert fallback["bound_tokens"] == NO_BOUND and fallback["rank_tokens"] is None  # no champion: reserve max_tokens
        train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
        assert server.refresh() and server.version == "1" and server.swaps == 1 and server.unavailable is None
        assert not server.refresh()  # nothing new
        out = server.predict_batch(["say yes", "write a long essay about the sea"])
        assert [o["version"] for o in out] == ["1", "1"] and len(out[0]["probabilities"]) == 10
        assert all(1.0 <= o["rank_tokens"] <= 1024 for o in out)  # what the online scheduler orders by
        train_and_register(CONFIG, SPEC, train=TRAIN[:16], evalset=EVAL, promote=False, store=paths.predictor_store())
        registry.set_champion("2")
        assert server.refresh() and server.version == "2"
    finally:
        server.close()


def test_a_failing_poll_does_not_end_the_poller(home: Path, monkeypatch: pytest.MonkeyPatch):
    server = LengthPredictorServer({"poll_s": 0.02})
    calls = []

    def flaky_refresh():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("new version failed its warm-up")
        return False

    monkeypatch.setattr(server, "refresh", flaky_refresh)
    try:
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(calls) >= 3 and server.poll_errors == 1  # it polled on after the error
    finally:
        server.close()


def test_a_declined_retrain_holds_the_trigger(monkeypatch: pytest.MonkeyPatch):
    import ray

    import predictor.training.retrain
    from app.config import PredictorConfig
    from deployments.retrain import RetrainTrigger
    from predictor.object_store import ObjectStore

    trigger = RetrainTrigger(PredictorConfig.model_validate({"retrain": {"retry_after_s": 600}}), paths.predictor_store(),
                             ObjectStore(paths.home()))
    trigger.running = "task"
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (refs, []))
    monkeypatch.setattr(ray, "get", lambda ref: {"retrained": False, "reason": "too little usable feedback"})
    due = []
    monkeypatch.setattr(predictor.training.retrain, "retrain_due", lambda policy, spec, feedback, store: due.append(1))
    trigger.tick(SPEC)
    trigger.tick(SPEC)
    assert trigger.running is None and due == [] and trigger.hold_until_s > time.monotonic() + 500
    trigger.hold_until_s = 0.0
    trigger.tick(SPEC)
    assert due == [1]


@pytest.mark.slow
def test_serve_deployment_batches_and_reports_its_version(home: Path):
    import ray
    from ray import serve

    from deployments.predictor import PredictorDeployment

    train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
    env = {"FORESERVE_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on port 8000
        handle = serve.run(PredictorDeployment.bind({"poll_s": 3600}), name="predictor-test", route_prefix=None)

        async def burst() -> list[dict]:
            return await asyncio.gather(*(handle.predict.remote(f"question {i}") for i in range(20)))

        results = asyncio.run(burst())
        assert len(results) == 20 and {r["version"] for r in results} == {"1"}
        assert handle.info.remote().result()["version"] == "1"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_an_unreachable_registry_is_reported_and_the_champion_keeps_serving(home: Path, monkeypatch: pytest.MonkeyPatch):
    train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
    seen = []
    server = LengthPredictorServer({"poll_s": 3600}, on_registry=seen.append)
    try:
        assert server.version == "1" and server.registry_error is None

        def down(client=None):
            raise ConnectionError("registry at http://10.0.0.9:5000 refused the connection")

        monkeypatch.setattr(registry, "champion_version", down)
        assert not server.refresh()
        assert server.version == "1" and "ConnectionError: registry at http://10.0.0.9:5000" in server.registry_error
        monkeypatch.undo()
        assert not server.refresh() and server.registry_error is None
        assert seen == [False, True]
    finally:
        server.close()
