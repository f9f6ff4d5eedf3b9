"""The predictor's encoder without transformers: a BERT encoder (MiniLM-L6) in plain torch, and its
WordPiece tokenizer through the ``tokenizers`` library.

The length predictor loads in every batch job's predictor actor, in the Serve predictor replica
and in each retraining task; importing transformers' model stack for it took ~1.7 s of a ~3.5 s
load here, its tokenizer wrapper another ~1.5 s on its own. This module computes what
``transformers.BertModel`` computes (its ``last_hidden_state``; ``tests/unit/test_predictor_encoder.py``
checks them equal) with the same parameter names, so saved predictors and the backbone's weights
load as they are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn

from predictor.modules import embedding

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class EncoderConfig(BaseModel):
    """The fields of a BERT ``config.json`` this encoder uses (the file is kept whole on save)."""

    model_config = ConfigDict(extra="allow")

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    hidden_act: str = "gelu"
    model_type: str = "bert"

    @classmethod
    def from_pretrained(cls, directory: Path) -> "EncoderConfig":
        config = cls.model_validate(json.loads((Path(directory) / "config.json").read_text()))
        if config.model_type != "bert" or config.hidden_act != "gelu":
            raise ValueError(f"{directory}: a BERT encoder with gelu is expected, not {config.model_type}/{config.hidden_act}")
        return config

    def save_pretrained(self, directory: Path) -> None:
        (Path(directory) / "config.json").write_text(self.model_dump_json(indent=2))


class Embeddings(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = embedding(c.vocab_size, c.hidden_size, padding_idx=0)
        self.position_embeddings = embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # NOTE: one segment: token type 0 everywhere, as the predictor feeds it
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.dropout_p = c.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=self.dropout_p if self.training else 0.0)
        return out.transpose(1, 2).reshape(b, t, d)


class DenseResidual(nn.Module):
    """``LayerNorm(residual + dropout(dense(x)))``: BERT's attention output and FFN output."""

    def __init__(self, c: EncoderConfig, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


class Attention(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.self = SelfAttention(c)
        self.output = DenseResidual(c, c.hidden_size)


class Dense(nn.Module):
    """One ``dense`` linear: BERT's FFN input (``intermediate``) and its pooler, named as its
    checkpoints name them (the pooler is kept so that they load whole; the predictor mean-pools)."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width_in, width_out)


class Layer(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Dense(c.hidden_size, c.intermediate_size)
        self.output = DenseResidual(c, c.intermediate_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, bias), x)
        return self.output(F.gelu(self.intermediate.dense(x)), x)


class Stack(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))


class BertEncoder(nn.Module):
    """``forward(input_ids, attention_mask) -> last hidden states [batch, tokens, hidden]``."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Stack(config)
        self.pooler = Dense(config.hidden_size, config.hidden_size)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        # additive key mask, [batch, 1, 1, tokens]: padding gets the dtype's most negative value
        bias = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x

    @classmethod
    def from_pretrained(cls, directory: Path) -> "BertEncoder":
        """The encoder of ``directory``: its ``config.json`` and ``model.safetensors``."""
        with torch.device("meta"):
            model = cls(EncoderConfig.from_pretrained(directory))
        model.load_state_dict(load_weights(Path(directory) / "model.safetensors"), strict=True, assign=True)
        return model


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors without the buffers BERT checkpoints may carry (``position_ids``),
    which this encoder computes instead."""
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(path)).items() if not k.endswith("position_ids")}


class WordPieceTokenizer:
    """The backbone's fast tokenizer (``tokenizer.json``) through ``tokenizers``: the calls the
    predictor makes of a transformers tokenizer, without importing transformers."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.backend = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        self.backend.no_truncation()
        self.backend.no_padding()
        ids = {name: self.backend.token_to_id(name) for name in ("[CLS]", "[SEP]", "[PAD]")}
        if None in ids.values():
            raise ValueError(f"{directory}/tokenizer.json has no {[k for k, v in ids.items() if v is None]} token")
        self.cls_token_id, self.sep_token_id, self.pad_token_id = ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]

    @classmethod
    def from_pretrained(cls, directory: Path) -> "WordPieceTokenizer":
        return cls(directory)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens, no truncation."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids)

    def save_pretrained(self, directory: Path) -> None:
        for name in TOKENIZER_FILES:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, Path(directory) / name)
