"""The feedback store: round trip, many concurrent writers, crash leftovers, validation (the chunk
writer under it, on S3 too: tests/unit/test_object_store.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.paths import feedback_dir
from predictor.feedback import (
    FeedbackRecord,
    FeedbackWriter,
    count_feedback,
    read_feedback,
    scan_feedback,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_record(request_id: str, **overrides) -> FeedbackRecord:
    fields = dict(
        request_id=request_id,
        prompt="Tell me a story \u00e9\u4e2d\n with a newline",
        predicted_bucket=3,
        predicted_bound_tokens=409,
        output_tokens=321,
        finish_reason="stop",
        tier="interactive",
        model_id="SmolLM2-135M-Instruct",
        predictor_version="bert-v1",
    )
    fields.update(overrides)
    return FeedbackRecord(**fields)


def test_round_trip_preserves_fields(tmp_path: Path) -> None:
    first = make_record("r1", prompt_token_ids=[1, 2, 3], timestamp_s=100.0)
    second = make_record("r2", predicted_bucket=None, predicted_bound_tokens=None, predictor_version=None)
    third = make_record("r3", output_tokens=0, finish_reason="abort", source="offline", timestamp_s=300.0)
    with FeedbackWriter(tmp_path) as writer:
        writer.append(first)
        writer.append_many([second, third])
        assert writer.name.startswith(f"{socket.gethostname()}-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{writer.name}-000000000.jsonl", f"{writer.name}-000000001.jsonl"]
    assert read_feedback(tmp_path) == [first, second, third]
    assert second.source == "online" and second.timestamp_s > 300.0
    assert [r.request_id for r in read_feedback(tmp_path, since_s=200.0)] == ["r2", "r3"]
    assert count_feedback(tmp_path) == 3


WRITER_SCRIPT = textwrap.dedent(
    """
    import sys
    from predictor.feedback import FeedbackRecord, FeedbackWriter
    root, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with FeedbackWriter(root, flush_s=0.01) as writer:
        for i in range(n):
            writer.append(FeedbackRecord(
                request_id=f"{tag}-{i}", prompt="p" * (i % 50), predicted_bucket=None,
                predicted_bound_tokens=None, output_tokens=i, finish_reason="stop", tier="t",
                model_id="m", predictor_version=None))
    """
)


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(tmp_path), f"proc{p}", "200"], env=env)
        for p in range(4)
    ]
    expected = {f"proc{p}-{i}" for p in range(4) for i in range(200)}

    # Four threads share one writer while the processes write theirs.
    with FeedbackWriter(tmp_path) as shared:

        def write_thread(t: int) -> None:
            for i in range(100):
                shared.append(make_record(f"thread{t}-{i}"))

        threads = [threading.Thread(target=write_thread, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    expected |= {f"thread{t}-{i}" for t in range(4) for i in range(100)}

    for proc in procs:
        assert proc.wait(timeout=60) == 0
    records, skipped_lines = scan_feedback(tmp_path)
    ids = [r.request_id for r in records]
    assert skipped_lines == 0
    assert len(ids) == len(expected) == 1200
    assert set(ids) == expected
    assert len({p.name.rsplit("-", 1)[0] for p in tmp_path.glob("*.jsonl")}) == 5  # a writer's chunks are its own


def test_truncated_and_garbage_lines_are_skipped(tmp_path: Path) -> None:
    with FeedbackWriter(tmp_path) as writer:
        writer.append_many([make_record("a1"), make_record("a2")])
    # A crashed writer: two good lines, a garbage line, then half a record with no newline.
    b1 = make_record("b1", prompt_token_ids=[5, 6])
    good = b1.model_dump_json() + "\n" + make_record("b2").model_dump_json() + "\n"
    half = make_record("b3").model_dump_json()[:40]
    (tmp_path / "crashed-1-deadbeef.jsonl").write_bytes((good + "not json {\n" + half).encode())

    records, skipped_lines = scan_feedback(tmp_path)
    assert sorted(r.request_id for r in records) == ["a1", "a2", "b1", "b2"]
    assert skipped_lines == 2
    assert next(r for r in records if r.request_id == "b1") == b1
    # A new writer's records are unaffected by the leftovers.
    with FeedbackWriter(tmp_path) as writer:
        writer.append(make_record("c1"))
    assert count_feedback(tmp_path) == 5


def test_missing_root_is_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_feedback(tmp_path / "nope") == []
    assert scan_feedback(tmp_path / "nope") == ([], 0)
    monkeypatch.setenv("FORESERVE_HOME", str(tmp_path / "home"))
    assert feedback_dir() == tmp_path / "home" / "feedback"
    assert read_feedback(feedback_dir()) == [] and count_feedback(feedback_dir()) == 0


def test_validation_rejects_bad_records() -> None:
    with pytest.raises(ValidationError):
        make_record("x", output_tokens=-1)
    with pytest.raises(ValidationError):
        make_record("x", predicted_bucket=-1)
