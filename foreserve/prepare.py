"""`foreserve prepare`: everything the engine and benchmarks need on disk, built once."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from app.prepare.model import DEFAULT_MODEL, ensure_model, ensure_served_model, gguf_path, model_folder, model_ready
from app.prepare.traces import MANIFEST, ensure_traces, source_path


def prepare(force: bool = False, predictor: bool = True, model: str = DEFAULT_MODEL) -> dict:
    """Build the model folder and the ShareGPT traces (first turns: the train conversations' later
    turns wait for the predictor's full recipe) if absent (``force`` rebuilds the traces), and
    meanwhile the engine's CPU kernels (once per machine and checkout: its first replica then starts
    without a minute's compile here; the compiler runs beside the model's conversion and the traces'
    tokenizer); then train, register and promote a first length predictor if MLflow has no champion.

    ``model``: a model to make ready beside the embedded one (a packaged model's short name or a GGUF
    file, converted; a folder, checked: ``app.prepare.model.ensure_served_model``). Returns a summary: paths, per-split record counts, the predictor and seconds spent.
    """
    from app.engine.model.cpu_kernels import paged_decode_op

    t0 = time.perf_counter()
    source_path()  # NOTE: a missing data package fails here, not after the kernel build it would wait for
    if not model_ready():
        gguf_path()
    with ThreadPoolExecutor(1) as pool:  # NOTE: the build waits on g++ and ninja, outside the GIL
        building = pool.submit(paged_decode_op)
        model_path = ensure_model()
        if model_folder(model) != model_path:
            model_path = ensure_served_model(model)
        t1 = time.perf_counter()
        traces_path = ensure_traces(force=force)
        kernel = building.result() is not None
    t2 = time.perf_counter()
    manifest = json.loads((traces_path / MANIFEST).read_text())
    champion = None
    if predictor:
        from app import paths
        from predictor import registry
        from predictor.training.pipeline import ensure_champion

        store = paths.predictor_store()
        trained = ensure_champion(store, traces_path)
        champion = {"version": registry.champion_version(registry.configure(store)), "trained_now": trained}
    t3 = time.perf_counter()
    return {
        "model_dir": str(model_path),
        "traces_dir": str(traces_path),
        "trace_files": {s: str(traces_path / f"{s}.jsonl") for s in manifest["counts"]},
        "trace_counts": manifest["counts"],
        "paged_decode_kernel": kernel,
        "predictor": champion,
        "seconds": {"model": round(t1 - t0, 2), "traces_and_kernel": round(t2 - t1, 2), "predictor": round(t3 - t2, 2)},
    }
