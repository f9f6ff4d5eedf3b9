"""Predictor inference speed on CPU: prompts/s at batch 1 and batch 32 on validation prompts."""

from __future__ import annotations

import time

import numpy as np


def measure(predictor, texts: list[str], batch_size: int, repeats: int = 3) -> dict:
    """Median prompts/s over ``repeats`` passes of ``texts`` in batches of ``batch_size``
    (the predictor's own length sorting applies within a batch, as in serving)."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for start in range(0, len(texts), batch_size):
            predictor.predict(texts[start : start + batch_size])
        rates.append(len(texts) / (time.perf_counter() - t0))
    return {"batch_size": batch_size, "prompts": len(texts), "prompts_per_s": round(float(np.median(rates)), 1),
            "ms_per_batch": round(1000 * batch_size / float(np.median(rates)), 1)}


def run(version: str = "champion", num_prompts: int = 256, threads: int | None = None) -> dict:
    import torch

    from app import paths
    from app.prepare.traces import ensure_traces
    from predictor.loading import load_predictor
    from predictor.training.dataset import trace_examples

    if threads:
        torch.set_num_threads(threads)
    predictor = load_predictor(version, store=paths.predictor_store())
    texts = [e.text for e in trace_examples(ensure_traces(), "validation")[:num_prompts]]
    predictor.predict(texts[:8])  # warm-up
    return {
        "version": predictor.version,
        "torch_threads": torch.get_num_threads(),
        "bf16": predictor.bf16,
        "results": [measure(predictor, texts, 1), measure(predictor, texts, 32)],
    }
