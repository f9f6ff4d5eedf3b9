"""`foreserve predictor collect` on the real model: every prompt answered once, and a stopped
collection resumes where it was instead of answering again."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import paths
from app.prepare.traces import load_trace
from app.prepare.collect import collect_feedback, request_id
from predictor.feedback import scan_feedback

pytestmark = [pytest.mark.model, pytest.mark.traces, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_collect_writes_one_record_per_prompt_and_resumes(tmp_path: Path):
    champion_store = paths.predictor_store()  # the prepared data dir's champion predicts
    first = collect_feedback(2, max_tokens=4, kv_cache_tokens=4096, root=tmp_path, store=champion_store)
    assert first["requests"] == 2 and first["already_answered"] == 0
    more = collect_feedback(3, max_tokens=4, kv_cache_tokens=4096, root=tmp_path, store=champion_store)
    assert more["requests"] == 1 and more["already_answered"] == 2
    assert collect_feedback(3, max_tokens=4, kv_cache_tokens=4096, root=tmp_path, store=champion_store) == {"requests": 0, "already_answered": 3}

    records, skipped = scan_feedback(tmp_path)
    expected = [request_id("validation", r.id) for r in load_trace("validation")[:3]]
    assert skipped == 0 and sorted(r.request_id for r in records) == sorted(expected)
    for r in records:
        assert 1 <= r.output_tokens <= 4 and r.finish_reason in ("stop", "length") and not r.ignore_eos
