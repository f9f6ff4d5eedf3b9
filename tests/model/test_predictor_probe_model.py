"""The frozen-feature probe on the serving model's own features (real SmolLM2)."""

from __future__ import annotations

import numpy as np
import pytest

from scripts.predictor_probe import serving_model_features


@pytest.mark.model
def test_serving_model_features_do_not_depend_on_batch_neighbours():
    """Left padding and the mask: a prompt's features are the same alone and beside longer ones."""
    texts = ["Write a haiku about the sea.", "Explain in detail how a transformer's attention works, with examples."]
    alone = serving_model_features(texts[:1], max_tokens=64)
    together = serving_model_features(texts, max_tokens=64)
    for name in ("serving L12", "serving last"):
        np.testing.assert_allclose(alone[name][0], together[name][0], atol=2e-4)
