"""foreserve's transformers-free tokenizer against transformers' own: its fallbacks, without a
checkpoint (the comparisons on the real SmolLM2: tests/model/test_llama_model.py; the model families
and what they refuse: tests/unit/test_architectures.py).
"""

from __future__ import annotations

import os


from app.engine.text.tokenizer import ChatTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_tokenizer_without_tokenizer_json_is_left_to_transformers(tmp_path):
    assert ChatTokenizer.from_dir(tmp_path) is None
