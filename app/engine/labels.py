"""The label a finished request leaves for the predictor's retraining: one ``FeedbackRecord``."""

from __future__ import annotations

from app.engine.request import Request
from predictor.feedback import FeedbackRecord


def feedback_record(req: Request, model_id: str) -> FeedbackRecord:
    """``req``'s true output length beside what was predicted for it.

    NOTE: the predictor's bound as it came (growth and preemption raise ``req.predicted_output_tokens``
    later), at its own quantile whatever the pool reserved: the labels and the retraining trigger
    judge the predictor, not the pool's choice."""
    pred = req.prediction
    own = pred.bound_tokens if pred.predictor_bound_tokens is None else pred.predictor_bound_tokens
    return FeedbackRecord(
        request_id=req.request_id,
        prompt=req.predictor_text,
        predicted_bucket=pred.bucket if pred.bucket >= 0 else None,
        predicted_bound_tokens=max(1, min(int(own), req.sampling.max_tokens)),
        output_tokens=req.num_output_tokens,
        finish_reason=req.finish_reason or "unknown",
        ignore_eos=req.sampling.ignore_eos,
        tier=req.tier,
        model_id=model_id,
        predictor_version=pred.version,
        source="offline" if req.tier == "offline" else "online",
    )
