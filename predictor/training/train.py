"""Fine-tune the length model end to end: soft ordinal bucket labels + log-length regression +
an in-batch pairwise ranking loss. Deterministic for a given seed and thread count."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from tqdm import tqdm

from predictor.training.dataset import Example
from predictor.learned import LearnedPredictor, decode
from predictor.training.metrics import score_predictions
from predictor.model import LengthModel, ModelSpec, collate, cpu_has_fast_bf16, encode_prompts


class TrainConfig(BaseModel):
    """Optimisation settings (logged to MLflow as params)."""

    epochs: int = Field(3, ge=1, description="Passes over the training examples.")
    lr: float = Field(8e-5, gt=0, description="Peak learning rate of the encoder.")
    head_lr: float = Field(1e-3, gt=0, description="Peak learning rate of the two heads.")
    weight_decay: float = Field(0.01, ge=0)
    warmup_frac: float = Field(0.06, ge=0, le=0.5, description="Linear warm-up share of all steps, then linear decay.")
    batch_tokens: int = Field(3072, ge=64, description="Padded encoder tokens per batch (batches are length-sorted).")
    max_batch_size: int = Field(64, ge=1)
    soft_label_sigma: float = Field(0.75, ge=0, description="Std (in buckets) of the Gaussian soft labels; 0 = one-hot.")
    score_weight: float = Field(0.5, ge=0, description="Weight of the log-length regression loss.")
    rank_weight: float = Field(1.0, ge=0, description="Weight of the pairwise ranking loss on the score.")
    freeze_embeddings: bool = Field(True, description="Keep the word embeddings fixed (half the weights; 2x faster steps on CPU).")
    bf16: bool | None = Field(None, description="bfloat16 autocast for the encoder (2x faster on CPUs with AVX512-BF16/AMX, 10x slower without); empty: when the CPU has them.")
    max_train_examples: int | None = Field(None, ge=1, description="Train on a seeded sample of this size.")
    seed: int = 0


EpochCallback = Callable[[int, dict[str, float]], None]


def log_length(tokens: np.ndarray, spec: ModelSpec) -> np.ndarray:
    return np.log1p(np.minimum(tokens, spec.max_tokens).astype(np.float64))


def make_batches(lengths: list[int], batch_tokens: int, max_batch_size: int, rng: np.random.Generator) -> list[list[int]]:
    """Shuffle, sort within windows of ~50 batches by length, cut by padded-token budget, shuffle batches."""
    order = rng.permutation(len(lengths))
    window = max(max_batch_size * 50, 1)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batch: list[int] = []
        width = 0
        for i in chunk:
            w = max(width, lengths[i])
            if batch and (w * (len(batch) + 1) > batch_tokens or len(batch) >= max_batch_size):
                batches.append(batch)
                batch, w = [], lengths[i]
            batch.append(int(i))
            width = w
        if batch:
            batches.append(batch)
    return [batches[i] for i in rng.permutation(len(batches))]


def soft_targets(true_buckets: torch.Tensor, num_buckets: int, sigma: float) -> torch.Tensor:
    if sigma <= 0:
        return F.one_hot(true_buckets, num_buckets).float()
    grid = torch.arange(num_buckets, dtype=torch.float32)
    logits = -((grid[None, :] - true_buckets[:, None].float()) ** 2) / (2 * sigma**2)
    return torch.softmax(logits, dim=1)


def losses(logits, score, targets, z, config: TrainConfig) -> torch.Tensor:
    ce = -(targets * F.log_softmax(logits, dim=1)).sum(1).mean()
    mse = F.mse_loss(score, z)
    dz = z[:, None] - z[None, :]
    pairs = dz > 0.1  # i is clearly longer than j
    rank = F.softplus(-(score[:, None] - score[None, :]))[pairs].mean() if pairs.any() else score.sum() * 0
    return ce + config.score_weight * mse + config.rank_weight * rank


def evaluate(predictor: LearnedPredictor, examples: list[Example], bound_quantile: float | None = None) -> dict[str, float]:
    probs, scores = predictor.infer([e.text for e in examples])
    argmax, bounds, expected = decode(probs, predictor.spec, bound_quantile if bound_quantile is not None else predictor.bound_quantile)
    buckets = predictor.spec.buckets
    true = np.array([e.output_tokens for e in examples])
    return score_predictions(true, argmax, bounds, expected, scores, buckets)


def train_model(
    train: list[Example],
    evalset: list[Example] | None,
    spec: ModelSpec,
    config: TrainConfig,
    on_epoch: EpochCallback | None = None,
    init: tuple[LengthModel, object] | None = None,
) -> tuple[LengthModel, object, list[dict[str, float]]]:
    """Returns the model, its tokenizer and per-epoch metrics (on ``evalset``, if given).
    ``init`` continues from an existing model (retraining) instead of the pretrained backbone."""
    if not train:
        raise ValueError("no training examples")
    rng = np.random.default_rng(config.seed)
    torch.manual_seed(config.seed)
    if config.max_train_examples and config.max_train_examples < len(train):
        train = [train[i] for i in sorted(rng.choice(len(train), config.max_train_examples, replace=False))]
    tokens = np.array([e.output_tokens for e in train])
    logs = log_length(tokens, spec)
    if init is None:
        spec = spec.model_copy(update={"score_mean": float(logs.mean()), "score_std": float(max(logs.std(), 1e-3))})
        model, tokenizer = LengthModel.from_backbone(spec)
    else:
        model, tokenizer = init
        spec = model.spec
    buckets = spec.buckets
    z_all = torch.tensor((logs - spec.score_mean) / spec.score_std, dtype=torch.float32)
    b_all = torch.tensor([buckets.bucket_of(int(min(t, spec.max_tokens))) for t in tokens])
    ids = encode_prompts(tokenizer, [e.text for e in train], spec)
    lengths = [len(t) for t in ids]

    if config.freeze_embeddings:
        model.encoder.get_input_embeddings().weight.requires_grad_(False)
    heads = [p for n, p in model.named_parameters() if not n.startswith("encoder.") and p.requires_grad]
    body = [p for n, p in model.named_parameters() if n.startswith("encoder.") and p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": body, "lr": config.lr}, {"params": heads, "lr": config.head_lr}],
        weight_decay=config.weight_decay,
    )
    epochs_batches = [make_batches(lengths, config.batch_tokens, config.max_batch_size, rng) for _ in range(config.epochs)]
    total_steps = sum(len(b) for b in epochs_batches)
    warmup = max(1, int(total_steps * config.warmup_frac))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (total_steps - s) / max(1, total_steps - warmup)))
    )
    history: list[dict[str, float]] = []
    bf16 = cpu_has_fast_bf16() if config.bf16 is None else config.bf16
    for epoch, batches in enumerate(epochs_batches, 1):
        model.train()
        t0, seen, loss_ema = time.perf_counter(), 0, math.nan
        bar = tqdm(batches, desc=f"train epoch {epoch}/{config.epochs}", unit="batch", leave=False)
        for batch in bar:
            input_ids, mask = collate([ids[i] for i in batch], tokenizer.pad_token_id)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits, score = model(input_ids, mask)
            logits, score = logits.float(), score.float()
            targets = soft_targets(b_all[batch], spec.num_buckets, config.soft_label_sigma)
            loss = losses(logits, score, targets, z_all[batch], config)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            seen += len(batch)
            loss_ema = loss.item() if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss.item()
            bar.set_postfix(loss=f"{loss_ema:.3f}")
        metrics = {"train_loss": float(loss_ema), "train_examples_per_s": seen / (time.perf_counter() - t0)}
        if evalset:
            metrics.update(evaluate(LearnedPredictor(model, tokenizer), evalset))
        history.append(metrics)
        tqdm.write(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        if on_epoch:
            on_epoch(epoch, metrics)
    model.eval()
    return model, tokenizer, history
