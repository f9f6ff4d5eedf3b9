"""The sequence limit from a KV byte budget uses the real model's bytes per token."""

from __future__ import annotations

import pytest

from app.config import EngineConfig


@pytest.mark.model
def test_sequence_limit_from_kv_bytes_uses_the_models_bytes_per_token():
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32 K and V
    assert EngineConfig(kv_cache_bytes=per_token * 1000, dtype="float32").sequence_limit_tokens() == 992
    assert EngineConfig(kv_cache_bytes=per_token * 1000, dtype="float32",
                        kv_cache_dtype="bfloat16").sequence_limit_tokens() == 2000 // 16 * 16
    auto = EngineConfig(kv_cache_bytes=per_token * 1000)  # bfloat16 weights and KV where the CPU has native bfloat16
    assert auto.sequence_limit_tokens() == (2000 // 16 * 16 if auto.weights_dtype == "bfloat16" else 992)
