"""An online replica reports each request's estimated and measured time to first token: a log line
and the estimate over the measured time (what ``ray_foreserve_ttft_estimate_ratio`` observes). The server
runs in this process, without Serve."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.ray]


def test_each_first_token_reports_its_estimate_and_its_error(tmp_path: Path, monkeypatch):
    from app import paths
    from deployments.engine_server import EngineServer

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / paths.model_dir().name).symlink_to(paths.model_dir())  # the prepared model, read-only
    monkeypatch.setenv("FORESERVE_HOME", str(home))
    ratios: list[float] = []
    server = EngineServer("online", {"kv_cache_tokens": 2048, "torch_threads": 1, "max_queue_delay_ms": 2000,
                                     "scheduler": "online"},
                          store=str(tmp_path / "store"), on_ttft_ratio=ratios.append)

    async def ask(rid: str, words: int) -> list[dict]:
        request = {"request_id": rid, "messages": [{"role": "user", "content": "Tell me more. " * words}],
                   "sampling": {"max_tokens": 4, "ignore_eos": True}, "prediction": {"bucket": 0, "bound_tokens": 4}}
        return [item async for item in server.generate(request)]

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    log = Records()
    serve_logger = logging.getLogger("ray.serve")  # NOTE: it does not propagate to the root (caplog's)
    serve_logger.addHandler(log)
    try:
        for i in range(12):  # past the warm-up steps, from which on each request is estimated
            assert asyncio.run(ask(f"r{i}", 5 + 20 * i))[-1]["completion_tokens"] == 4
    finally:
        serve_logger.removeHandler(log)
        server.shutdown()
    lines = [r for r in log.records if "first token in" in r.getMessage()]
    assert len(lines) == 12 and all(hasattr(r, "ttft_s") and r.ttft_s > 0 for r in lines)
    estimated = [r for r in lines if r.ttft_estimate_s is not None]
    assert len(ratios) == len(estimated) >= 6 and all(0 < e < 10 for e in ratios)
    assert all("estimated" in r.getMessage() for r in estimated)
