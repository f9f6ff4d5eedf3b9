"""How a batch job cuts its predicted rows into engine batches (``foreserve.batch.job.plan_batches``), and what
Ray resources its engine actors ask for (``engine_resources``)."""

from __future__ import annotations

import pytest

from app.config import EngineConfig
from foreserve.batch.job import plan_batches
from foreserve.batch.workers import engine_resources


def _rows(bounds: list[int]) -> list[dict]:
    return [{"line": i + 1, "bound_tokens": b} for i, b in enumerate(bounds)]


def test_more_rows_than_one_round_are_sorted_and_sliced():
    rows = _rows([512, 102, 307, 921, 205, 102, 716])
    batches = plan_batches(rows, batch_size=3, engines=2)
    assert [[r["bound_tokens"] for r in b] for b in batches] == [[102, 102, 205], [307, 512, 716], [921]]
    assert [r["line"] for r in batches[0]] == [2, 6, 5]  # stable: equal bounds keep their input order


def test_one_round_deals_a_like_mix_to_every_engine():
    rows = _rows([921, 102, 512, 205, 716, 307])
    batches = plan_batches(rows, batch_size=8, engines=2)
    assert [[r["bound_tokens"] for r in b] for b in batches] == [[102, 307, 716], [205, 512, 921]]
    assert plan_batches(rows[:1], batch_size=8, engines=3) == [rows[:1]]  # no empty batch for an idle engine
    assert plan_batches([], batch_size=8, engines=2) == []


def test_every_row_is_planned_exactly_once():
    rows = _rows([(i * 37) % 1024 for i in range(100)])
    for batch_size, engines in [(7, 1), (7, 3), (64, 2), (256, 1)]:
        lines = sorted(r["line"] for b in plan_batches(rows, batch_size, engines) for r in b)
        assert lines == list(range(1, 101))


def test_batch_engines_ask_ray_for_their_gpu_on_cuda():
    assert engine_resources(EngineConfig(), 1.0, cluster_gpus=0) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert engine_resources(EngineConfig(), 0.5, cluster_gpus=8) == {"num_cpus": 0.5, "num_gpus": 1.0}  # auto on a GPU cluster
    assert engine_resources(EngineConfig(device="cuda:0"), 1.0, cluster_gpus=0) == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert engine_resources(EngineConfig(device="cpu", tensor_parallel_size=2), 1.0, cluster_gpus=8) == {"num_cpus": 2.0, "num_gpus": 0.0}
    with pytest.raises(ValueError, match="placement group"):
        engine_resources(EngineConfig(device="cuda", tensor_parallel_size=2), 1.0, cluster_gpus=8)
