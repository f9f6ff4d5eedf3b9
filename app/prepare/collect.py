"""Collect feedback from the real serving model: run trace prompts through the engine with natural
EOS (no forced lengths) so the feedback store holds the model's *own* output lengths."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from app.config import EngineConfig
from app.engine.engine import LLMEngine
from app.engine.request import EngineRequest, Prediction, SamplingParams
from predictor.store import Store


def request_id(split: str, trace_id: str) -> str:
    return f"collect-{split}-{trace_id}"


def collect_feedback(
    num_prompts: int,
    split: str = "validation",
    offset: int = 0,
    max_tokens: int = 1024,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    kv_cache_tokens: int = 16384,
    torch_threads: int | None = None,
    *,
    root: Path,
    store: Store,
    trace_dir: Path | None = None,
) -> dict:
    """Generate answers for ``num_prompts`` trace prompts on the offline engine configuration
    (``reserve_predicted`` + ``offline``, the champion predicting); every finished request appends
    its feedback record. Prompts the store already holds an answer to (by request id) are skipped,
    so a stopped collection resumes where it was. ``root``: the feedback folder; ``store``: the
    registry the champion comes from; ``trace_dir``: the traces (default: built if absent). Returns
    counts and throughput."""
    from app.prepare.traces import load_trace
    from predictor.feedback import FeedbackWriter, scan_feedback
    from predictor.loading import load_predictor_or_max

    if num_prompts < 1 or offset < 0:
        raise ValueError(f"prompts must be >= 1 and offset >= 0, got {num_prompts} and {offset}")
    records = load_trace(split, trace_dir=trace_dir)[offset : offset + num_prompts]
    if not records:
        raise ValueError(f"no {split} prompts at offset {offset}")
    answered = {r.request_id for r in scan_feedback(root)[0]}
    todo = [(offset + j, r) for j, r in enumerate(records) if request_id(split, r.id) not in answered]
    if not todo:
        return {"requests": 0, "already_answered": len(records)}
    config = EngineConfig(
        allocation="reserve_predicted", scheduler="offline", kv_cache_tokens=kv_cache_tokens,
        default_max_tokens=max_tokens, max_model_len_tokens=max_tokens + 1024, torch_threads=torch_threads,
    )
    predictor = load_predictor_or_max("champion", store=store)
    with FeedbackWriter(root, flush_s=1.0) as writer:  # NOTE: a stopped run loses at most a second; resume redoes it
        engine = LLMEngine.from_config(config, predictor=predictor, feedback=writer)
        try:
            pred = predictor.predict([rec.user for _, rec in todo])
            version = None if getattr(predictor, "version", None) is None else str(predictor.version)
            for i, (position, rec) in enumerate(todo):
                engine.add_request(EngineRequest(
                    prompt=rec.prompt,
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + position),
                    request_id=request_id(split, rec.id),
                    tier="offline",
                    prediction=Prediction(bucket=pred.buckets[i], bound_tokens=pred.bound_tokens[i], version=version),
                    predictor_text=rec.user,
                    detokenize=False,
                ))
            with tqdm(total=len(todo), desc="collect feedback", unit="req") as bar:
                while engine.has_unfinished_requests():
                    done = sum(o.finished for o in engine.step())
                    bar.update(done)
            stats = engine.stats()
        finally:
            engine.shutdown()
    return {
        "requests": len(todo),
        "already_answered": len(records) - len(todo),
        "feedback": writer.store.uri,
        "feedback_chunks": writer.chunks_written,
        "output_tokens": stats.output_tokens,
        "wall_s": round(stats.wall_s, 1),
        "output_tokens_per_s": round(stats.output_tokens / max(stats.wall_s, 1e-9), 1),
        "preemptions": stats.preemptions,
        "predictor_version": getattr(predictor, "version", None),
    }
