"""The predictor's own BERT encoder and tokenizer (predictor/encoder.py) against transformers'."""

from __future__ import annotations

import pytest
import torch

from predictor.encoder import BertEncoder, WordPieceTokenizer
from predictor.model import backbone_path

TEXTS = [
    "Write a 500-word essay about the French Revolution.",
    "hi",
    "Écris un poème sur la mer, s'il te plaît — avec des rimes!",
    "def f(x):\n    return x ** 2  # what does this do?\n" * 20,
    "日本語で説明してください。Explain Kendall's τ in one line. 🙂",
    "",
]


@pytest.fixture(scope="module")
def backbone():
    return backbone_path()


def test_tokenizer_gives_the_transformers_ids(backbone):
    from transformers import AutoTokenizer

    ours, theirs = WordPieceTokenizer(backbone), AutoTokenizer.from_pretrained(backbone)
    assert ours.encode_batch(TEXTS) == theirs(TEXTS, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id) == (theirs.cls_token_id, theirs.sep_token_id, theirs.pad_token_id)


def test_encoder_computes_what_bert_model_computes(backbone):
    from transformers import AutoModel

    from predictor.model import ModelSpec, collate, encode_prompts

    tok = WordPieceTokenizer(backbone)
    ids = encode_prompts(tok, TEXTS, ModelSpec(max_input_tokens=128, head_tokens=32))
    input_ids, mask = collate(ids, tok.pad_token_id)  # padded: the key mask matters
    ours, theirs = BertEncoder.from_pretrained(backbone).eval(), AutoModel.from_pretrained(backbone).eval()
    with torch.inference_mode():
        a = ours(input_ids=input_ids, attention_mask=mask)
        b = theirs(input_ids=input_ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    assert a.shape == b.shape
    torch.testing.assert_close(a[valid], b[valid], atol=2e-5, rtol=1e-4)


def test_dropout_only_while_training(backbone):
    model = BertEncoder.from_pretrained(backbone)
    x, mask = torch.tensor([[101, 7592, 2088, 102]]), torch.ones(1, 4, dtype=torch.long)
    model.eval()
    assert torch.equal(model(x, mask), model(x, mask))
    model.train()
    assert not torch.equal(model(x, mask), model(x, mask))
