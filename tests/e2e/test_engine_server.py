"""The engine-server deployment on real Ray Serve with the real model: streaming, the feedback
record, routing stats, a rejected request's error and a client that walks away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import paths

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@contextlib.contextmanager
def _serving_from(home: Path) -> Iterator[None]:
    """A local Ray whose workers have ``home`` (the prepared model linked in, read-only) as their
    data dir; Serve and Ray shut down after."""
    import ray
    from ray import serve

    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())
    env = {"FORESERVE_HOME": str(home), "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def test_engine_server_streams_writes_feedback_and_reports_stats(tmp_path: Path):
    from ray import serve

    from deployments.engine_server import EngineServerDeployment
    from predictor.feedback import read_feedback

    feedback = tmp_path / "home"
    with _serving_from(feedback):
        app = EngineServerDeployment.options(name="online").bind("online", {"kv_cache_tokens": 2048, "torch_threads": 1})
        serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on port 8000
        handle = serve.run(app, name="engine-test", route_prefix=None).options(stream=True)
        request = {"request_id": "r1", "messages": [{"role": "user", "content": "Say hello."}],
                   "sampling": {"max_tokens": 8, "temperature": 0.0}, "prediction": {"bucket": 0, "bound_tokens": 102, "rank_tokens": 12.5, "version": "7"},
                   "predictor_text": "Say hello."}

        async def collect(req) -> list[dict]:
            return [item async for item in handle.generate.remote(req)]

        items = asyncio.run(collect(request))
        assert items[-1]["finished"] and items[-1]["completion_tokens"] == len(items) <= 8
        assert items[-1]["finish_reason"] in ("stop", "length") and "".join(i["text"] for i in items).strip()

        too_long = {**request, "request_id": "r2", "sampling": {"max_tokens": 5000}}
        (rejected,) = asyncio.run(collect(too_long))  # one typed error item, not an exception
        assert rejected["error"]["status_code"] == 400 and "exceeds" in rejected["error"]["message"]

        async def walk_away() -> None:
            stream = handle.generate.remote({**request, "request_id": "r3", "sampling": {"max_tokens": 200, "ignore_eos": True}})
            async for _ in stream:
                break
            stream.cancel()

        asyncio.run(walk_away())
        stats = serve.get_deployment_handle("online", "engine-test").stats.remote().result()
        for _ in range(50):  # the abort reaches the engine thread asynchronously
            if stats["kv_used_tokens"] == 0:
                break
            asyncio.run(asyncio.sleep(0.1))
            stats = serve.get_deployment_handle("online", "engine-test").stats.remote().result()
        assert stats["kv_used_tokens"] == 0 and stats["kv_capacity_tokens"] == 2048
        assert stats["recent_ttft_ms_p90"] > 0 and stats["recent_tpot_ms_p90"] > 0  # from r1's finished run
        scaling = serve.get_deployment_handle("online", "engine-test").record_autoscaling_stats.remote().result()
        assert all(isinstance(v, float) for v in scaling.values()) and scaling["kv_capacity_tokens"] == 2048.0
    records = {r.request_id: r for r in read_feedback(feedback / "feedback")}
    assert records["r1"].output_tokens == items[-1]["completion_tokens"] and records["r1"].predictor_version == "7"
    assert records["r3"].finish_reason == "abort"


def test_a_request_admitted_on_a_late_estimate_is_refused_with_a_429_item_once_its_wait_passes_the_limit(tmp_path: Path):
    """Predicted to end after one token, the answers run 200: the admission tests let every request
    of a burst in, one runs at a time (``max_num_seqs`` 1), and each of the others, unstarted when
    its wait passes ``max_queue_delay_ms``, ends with a 429 item (the ingress's 429 with
    Retry-After); none is answered late, none fails otherwise."""
    from ray import serve

    from deployments.engine_server import EngineServerDeployment

    with _serving_from(tmp_path / "home"):
        # The limit sits well above five predicted prompts (a few hundred ms each, even on a slow CPU)
        # and well below one real 200-token answer (a token takes 10 ms or more on one thread).
        overrides = {"kv_cache_tokens": 2048, "torch_threads": 1, "max_num_seqs": 1, "max_queue_delay_ms": 2500}
        app = EngineServerDeployment.options(name="online").bind("online", overrides)
        serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on port 8000
        handle = serve.run(app, name="late-test", route_prefix=None).options(stream=True)

        def request(rid: str, max_tokens: int) -> dict:
            return {"request_id": rid, "messages": [{"role": "user", "content": "Count to a hundred."}],
                    "sampling": {"max_tokens": max_tokens, "ignore_eos": True}, "prediction": {"bucket": 0, "bound_tokens": 1}}

        async def collect(req) -> list[dict]:
            return [item async for item in handle.generate.remote(req)]

        async def burst() -> list[list[dict]]:
            return await asyncio.gather(*(collect(request(f"b{i}", 200)) for i in range(5)))

        assert asyncio.run(collect(request("warm", 20)))[-1]["completion_tokens"] == 20  # the replica has stepped
        answers = asyncio.run(burst())
    refused = [a for a in answers if "error" in a[-1]]
    assert all(a[-1]["completion_tokens"] == 200 and a[-1]["finished"] for a in answers if a not in refused)
    assert 1 <= len(answers) - len(refused) < 5 and refused, [a[-1] for a in answers]
    for (item,) in refused:  # one item, no token before it
        assert item["error"]["status_code"] == 429, item
    assert any("without starting" in item["error"]["message"] for (item,) in refused), refused
