"""A tiny length-predictor recipe (data, training config, model spec): trains in seconds on the real
MiniLM backbone. Shared by the MLflow pipeline, the predictor deployment and the served-app tests."""

from __future__ import annotations

from predictor.model import ModelSpec
from predictor.training.dataset import Example
from predictor.training.train import TrainConfig

TRAIN = [Example(f"please write {'a long essay' if i % 2 else 'one word'} number {i}", 600 if i % 2 else 5) for i in range(32)]
EVAL = TRAIN[:12]
CONFIG = TrainConfig(epochs=1, batch_tokens=512, max_batch_size=16, seed=1)
SPEC = ModelSpec(max_input_tokens=32)
