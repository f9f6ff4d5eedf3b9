"""Settings of the predictor's side that the application's config embeds (``app.config.PredictorConfig``).

Plain pydantic models on the serving side of the predictor, so that ``app.config`` reads them
without importing the training stack (``predictor.training``)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RetrainPolicy(BaseModel):
    """When and how to retrain from feedback (``serve_config.yaml: predictor.training.retrain``)."""

    every_records: int = Field(500, ge=1, description="Retrain after this many new usable feedback records.")
    mispredict_rate: float = Field(0.5, gt=0, le=1, description="...or when this share of the recent window was mispredicted (bound too small, or off by more than one bucket).")
    window_records: int = Field(200, ge=1, description="Size of the recent window for the misprediction rate.")
    min_records: int = Field(50, ge=1, description="Never retrain on fewer new records than this.")
    holdout_frac: float = Field(0.2, gt=0, lt=1, description="Share of feedback prompts held out to gate the candidate.")
    original_examples: int = Field(300, ge=0, description="ShareGPT train examples mixed in so the model keeps what it knew (more pulls it back toward ShareGPT's lengths: 2,000 did worse on the model's own, README).")
    epochs: int = Field(4, ge=1, description="Epochs over feedback + original examples.")
    lr: float = Field(3e-5, gt=0, description="Encoder learning rate when continuing from the champion.")
    gate: bool = Field(True, description="Promote only a candidate that beats the champion on the held-out feedback; false promotes every retrained version (demos, tests).")
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved by the retraining task.")
    retry_after_s: float = Field(600.0, ge=0, description="After a retrain that failed or was declined (too little usable feedback), wait this long before the next.")
