"""The feedback store: one record per finished request, later used to retrain the length predictor.

Records are JSONL chunks in an ``ObjectStore`` (``predictor.records``): each writer puts objects of
its own, ``<host>-<pid>-<8 hex>-<seq>.jsonl``, so processes on any node never share one, and a
reader merges them all. Feedback files of the older append-only layout (``<host>-<pid>-<hex>.jsonl``)
read the same way. A line that does not parse or validate is skipped and counted, never fatal.

The store is the caller's: the data dir's (or the configured store's) ``feedback`` folder at the
entry points, a job's or a test's own folder elsewhere.
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, Field

from predictor.object_store import ObjectStore
from predictor.records import ChunkWriter, read_records


class FeedbackRecord(BaseModel):
    """What the engine knew and what actually happened for one finished request."""

    request_id: str = Field(description="The engine's request id.")
    prompt: str = Field(description="The user message text the predictor reads.")
    prompt_token_ids: list[int] | None = Field(None, description="The prompt's token ids, when kept.")
    predicted_bucket: int | None = Field(None, ge=0, description="The predicted length bucket; None without a predictor.")
    predicted_bound_tokens: int | None = Field(None, ge=0, description="The predictor's output bound for the request, in tokens, as it came (before any growth; at the predictor's own quantile, whatever the pool reserved), clamped to max_tokens.")
    output_tokens: int = Field(ge=0, description="The number of tokens actually generated.")
    finish_reason: str = Field(description='Why generation ended: "stop", "length", "abort", ...')
    ignore_eos: bool = Field(False, description="The client had EOS ignored (benchmarks, load tests) or forced a "
                             "replayed length: the length is the client's, not the model's, and is no label.")
    tier: str = Field(description="The service tier the request ran in.")
    model_id: str = Field(description="The served model's id.")
    predictor_version: str | None = Field(None, description="Name/version of the predictor that made the prediction.")
    timestamp_s: float = Field(default_factory=time.time, description="When the request finished (Unix seconds).")
    source: str = Field("online", description='Where the record comes from: "online" (the engine), "offline", ...')


class FeedbackWriter(ChunkWriter):
    """Feedback records into ``store`` (``predictor.records.ChunkWriter``): synchronous by default;
    an engine passes ``flush_s`` so that finishing a request never waits on the store."""


def scan_feedback(root: ObjectStore | str | Path, since_s: float | None = None) -> tuple[list[FeedbackRecord], int]:
    """The feedback records under ``root`` (see ``predictor.records.read_records``) and the
    skipped-line count; ``since_s`` keeps records with ``timestamp_s >= since_s``."""
    records, skipped_lines = read_records(root, FeedbackRecord)
    if since_s is not None:
        records = [r for r in records if r.timestamp_s >= since_s]
    return records, skipped_lines


def read_feedback(root: ObjectStore | str | Path, since_s: float | None = None) -> list[FeedbackRecord]:
    """The valid records under ``root`` (see ``scan_feedback``), without the skipped count."""
    return scan_feedback(root, since_s)[0]


def count_feedback(root: ObjectStore | str | Path) -> int:
    """The number of valid records under ``root``."""
    return len(read_feedback(root))
