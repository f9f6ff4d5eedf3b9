"""`foreserve prepare`: everything the engine and benchmarks need on disk, built once."""

from __future__ import annotations

import json
import time

from app.prepare.model import ensure_model
from app.prepare.traces import MANIFEST, SPLITS, ensure_traces


def prepare(force: bool = False) -> dict:
    """Build the model folder and the ShareGPT traces if absent (``force`` rebuilds the traces).

    Returns a summary: paths, per-split record counts and seconds spent.
    """
    t0 = time.perf_counter()
    model_path = ensure_model()
    t1 = time.perf_counter()
    traces_path = ensure_traces(force=force)
    t2 = time.perf_counter()
    manifest = json.loads((traces_path / MANIFEST).read_text())
    return {
        "model_dir": str(model_path),
        "traces_dir": str(traces_path),
        "trace_files": {s: str(traces_path / f"{s}.jsonl") for s in SPLITS},
        "trace_counts": manifest["counts"],
        "seconds": {"model": round(t1 - t0, 2), "traces": round(t2 - t1, 2)},
    }
