"""How much do other encoders know about ShareGPT answer lengths? Linear probes on frozen features.

    python -m scripts.predictor_probe --train-examples 8000 --version 5 --json reports/predictor_probe.json

Each feature set is computed for a seeded sample of the predictor's training examples and for the
selection prompts (validation minus anything seen in train), then probed the same way: a ridge
regression on the log length (its score ranks: Kendall tau) and a multinomial logistic regression on
the bucket (exact and ±1 bucket accuracy), each with its regularisation chosen by cross-validation
inside the data it is fitted on. Two ways:

- ``train_sample``: fitted on the training sample, scored on the selection prompts;
- ``selection_crossfit``: 5-fold out-of-fold predictions on the selection prompts alone. This is
  the fair one for a fine-tuned predictor, whose features of its own training prompts are in-sample.

Feature sets:

- ``serving L<k>`` / ``serving last`` / ``serving all layers``: the serving model
  (SmolLM2-135M-Instruct, 6x MiniLM's size) reading the chat-templated prompt, hidden states
  mean-pooled at layer k, at the last prompt token (where the answer starts), or all of them;
- ``backbone``: the pretrained MiniLM the predictor starts from, mean-pooled;
- ``predictor v<N>``: a registry version's fine-tuned encoder, mean-pooled (what its heads read);
- ``predictor v<N> + serving last``: both, to ask whether the bigger model knows something the
  fine-tuned predictor does not.

On this 2-core CPU the serving model's features take ~15 minutes for 8,000 training prompts and
~4 for the 1,779 selection prompts (a progress bar shows both).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau
from tqdm import tqdm

from predictor.buckets import LengthBuckets
from predictor.training.dataset import Example, selection_examples, training_examples

SERVING_LAYERS = (6, 12, 18, 24, 30)
ALPHAS = (1e2, 3e2, 1e3, 3e3, 1e4, 3e4, 1e5)
CS = (1e-5, 1e-4, 1e-3, 1e-2)
SET_NAMES = (*(f"serving L{k}" for k in SERVING_LAYERS), "serving last", "serving all layers", "backbone", "predictor",
             "predictor + serving last")


def _length_sorted_batches(lengths: list[int], budget_tokens: int, max_batch: int) -> list[np.ndarray]:
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and end - start < max_batch and (end - start + 1) * lengths[order[end]] <= budget_tokens:
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


def serving_model_features(texts: list[str], max_tokens: int = 256, desc: str = "serving model") -> dict[str, np.ndarray]:
    """Mean-pooled hidden states at ``SERVING_LAYERS`` and the last prompt token's final state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.prepare.model import ensure_model

    path = ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = []
    for text in texts:
        tokens = list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"])
        if len(tokens) > max_tokens:  # head and tail of the templated prompt (a quarter, three quarters)
            tokens = tokens[: max_tokens // 4] + tokens[-(max_tokens - max_tokens // 4):]
        ids.append(tokens)
    hidden = model.config.hidden_size
    out = {f"serving L{k}": np.zeros((len(texts), hidden), np.float32) for k in SERVING_LAYERS}
    out["serving last"] = np.zeros((len(texts), hidden), np.float32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = _length_sorted_batches([len(t) for t in ids], 4096, 64)
    with torch.inference_mode(), tqdm(total=len(texts), desc=desc, unit="prompt") as bar:
        for batch in batches:
            width = max(len(ids[i]) for i in batch)
            x = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):  # left padding: every row's last token is the last column
                x[row, width - len(ids[i]):] = torch.tensor(ids[i])
                mask[row, width - len(ids[i]):] = 1
            states = model.model(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states
            m = mask.unsqueeze(-1).float()
            for k in SERVING_LAYERS:
                out[f"serving L{k}"][batch] = ((states[k] * m).sum(1) / m.sum(1)).numpy()
            out["serving last"][batch] = states[-1][:, -1, :].numpy()
            bar.update(len(batch))
    return out


def minilm_features(texts: list[str], version: str | None, max_tokens: int = 256) -> np.ndarray:
    """Mean-pooled encoder output of the pretrained backbone (``version=None``) or a registry version."""
    import torch

    from app import paths
    from predictor.loading import load_predictor
    from predictor.model import LengthModel, ModelSpec, collate, encode_prompts

    if version is None:
        model, tokenizer = LengthModel.from_backbone(ModelSpec(max_input_tokens=max_tokens))
    else:
        predictor = load_predictor(version, store=paths.predictor_store())
        model, tokenizer = predictor.model, predictor.tokenizer
    model.eval()
    ids = encode_prompts(tokenizer, texts, model.spec.model_copy(update={"max_input_tokens": max_tokens}))
    out = np.zeros((len(texts), model.encoder.config.hidden_size), np.float32)
    with torch.inference_mode():
        for batch in tqdm(_length_sorted_batches([len(t) for t in ids], 8192, 64), desc=f"MiniLM {version or 'backbone'}", unit="batch"):
            x, mask = collate([ids[i] for i in batch], tokenizer.pad_token_id)
            out[batch] = model.embed(x, mask).numpy()
    return out


def _fit_predict(train_x: np.ndarray, train_capped: np.ndarray, test_x: np.ndarray, buckets: LengthBuckets,
                 seed: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Ridge on the log length (a ranking score) and logistic regression on the bucket, each with
    its regularisation chosen by cross-validation inside ``train_x`` only."""
    from sklearn.linear_model import LogisticRegressionCV, RidgeCV
    from sklearn.model_selection import KFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    ridge = make_pipeline(StandardScaler(), RidgeCV(alphas=ALPHAS)).fit(train_x, np.log1p(train_capped))
    logistic = make_pipeline(StandardScaler(), LogisticRegressionCV(
        Cs=list(CS), cv=KFold(3, shuffle=True, random_state=seed), scoring="accuracy", max_iter=500))
    logistic.fit(train_x, _to_buckets(train_capped, buckets))
    return ridge.predict(test_x), logistic.predict(test_x), float(ridge[-1].alpha_), float(logistic[-1].C_[0])


def _to_buckets(capped: np.ndarray, buckets: LengthBuckets) -> np.ndarray:
    return np.array([buckets.bucket_of(int(t)) for t in capped], dtype=np.int64)


def _scores(score: np.ndarray, pred: np.ndarray, capped: np.ndarray, buckets: LengthBuckets) -> dict[str, float]:
    true = _to_buckets(capped, buckets)
    return {"kendall_tau": round(float(kendalltau(score, capped).statistic), 4),
            "exact_bucket_acc": round(float(np.mean(pred == true)), 4),
            "within1_bucket_acc": round(float(np.mean(np.abs(pred - true) <= 1)), 4)}


def probe(train_x: np.ndarray, train_tokens: np.ndarray, test_x: np.ndarray, test_tokens: np.ndarray,
          buckets: LengthBuckets, seed: int = 0) -> dict[str, float]:
    """Fit on the training sample, score on the test prompts. Lengths past ``max_tokens`` count as
    ``max_tokens``, as in ``predictor.training.metrics``."""
    train_capped = np.minimum(train_tokens, buckets.max_tokens)
    test_capped = np.minimum(test_tokens, buckets.max_tokens)
    score, pred, alpha, c = _fit_predict(train_x, train_capped, test_x, buckets, seed)
    out = _scores(score, pred, test_capped, buckets)
    edge = [name for name, value, grid in (("ridge alpha", alpha, ALPHAS), ("logistic C", c, CS)) if value in (grid[0], grid[-1])]
    return {**out, "ridge_alpha": alpha, "logistic_c": c, "at_grid_edge": edge, "dim": int(train_x.shape[1])}


def crossfit(x: np.ndarray, tokens: np.ndarray, buckets: LengthBuckets, folds: int = 5, seed: int = 0) -> dict[str, float]:
    """Out-of-fold predictions on one set of prompts: each fold is scored by probes fitted on the
    others. The fair test for features of a model that was trained on the training sample itself."""
    from sklearn.model_selection import KFold

    capped = np.minimum(tokens, buckets.max_tokens)
    score, pred = np.zeros(len(x)), np.zeros(len(x), dtype=np.int64)
    for train_idx, test_idx in KFold(folds, shuffle=True, random_state=seed).split(x):
        score[test_idx], pred[test_idx], _, _ = _fit_predict(x[train_idx], capped[train_idx], x[test_idx], buckets, seed)
    return {**_scores(score, pred, capped, buckets), "dim": int(x.shape[1])}


def compute_features(train: list[Example], test: list[Example], version: str, max_tokens: int) -> dict[str, np.ndarray]:
    """Every feature set, as ``<name>|train`` and ``<name>|test`` arrays."""
    feats: dict[str, np.ndarray] = {}
    for part, examples in (("train", train), ("test", test)):
        texts = [e.text for e in examples]
        serving = serving_model_features(texts, max_tokens, f"serving model, {part}")
        for name, x in serving.items():
            feats[f"{name}|{part}"] = x
        feats[f"serving all layers|{part}"] = np.concatenate(list(serving.values()), 1)
        feats[f"backbone|{part}"] = minilm_features(texts, None, max_tokens)
        predictor = minilm_features(texts, version, max_tokens)
        feats[f"predictor|{part}"] = predictor
        feats[f"predictor + serving last|{part}"] = np.concatenate([predictor, serving["serving last"]], 1)
    return feats


def run(train_examples: int = 8000, version: str = "champion", max_tokens: int = 256, seed: int = 0,
        selection_limit: int | None = None, features_file: Path | None = None, sets: list[str] | None = None) -> dict:
    """``version`` must already be resolved to a number (``resolve_version``)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", module="sklearn")
    torch.manual_seed(seed)
    from app.prepare.traces import ensure_traces

    traces = ensure_traces()
    train: list[Example] = training_examples(traces, "all")
    random.Random(seed).shuffle(train)
    train = train[:train_examples]
    test = selection_examples(traces)[:selection_limit]
    buckets = LengthBuckets(max_tokens=1024, num_buckets=10)
    config = {"train_examples": len(train), "selection_examples": len(test), "version": version,
              "max_input_tokens": max_tokens, "seed": seed}
    feats = None
    if features_file and features_file.is_file():
        cached = np.load(features_file, allow_pickle=False)
        if json.loads(str(cached["config"])) == config:
            feats = {k: cached[k] for k in cached.files if k != "config"}
            print(f"features from {features_file}")
    if feats is None:
        feats = compute_features(train, test, version, max_tokens)
        if features_file:
            features_file.parent.mkdir(parents=True, exist_ok=True)
            np.savez(features_file, config=json.dumps(config), **feats)
    y_train = np.array([e.output_tokens for e in train])
    y_test = np.array([e.output_tokens for e in test])
    names = [k.split("|")[0] for k in feats if k.endswith("|train")]
    names = [n for n in names if not sets or n in sets]
    results = {}
    for name in tqdm(names, desc="probes", unit="set"):
        label = name.replace("predictor", f"predictor v{version}")
        results[label] = {"train_sample": probe(feats[f"{name}|train"], y_train, feats[f"{name}|test"], y_test, buckets, seed),
                          "selection_crossfit": crossfit(feats[f"{name}|test"], y_test, buckets, seed=seed)}
        tqdm.write(f"{label:36s} " + "  ".join(f"{part}: tau {r['kendall_tau']:.3f} exact {r['exact_bucket_acc']:.3f} "
                                               f"±1 {r['within1_bucket_acc']:.3f}" for part, r in results[label].items()))
    return {"config": config, "results": results}


def resolve_version(name: str) -> str:
    """The registry version behind ``champion`` or a number; fails before any feature is computed."""
    from app import paths
    from predictor.loading import load_predictor

    predictor = load_predictor(name, store=paths.predictor_store())
    if not hasattr(predictor, "model"):
        raise ValueError(f"{name!r} is not a learned predictor")
    return str(predictor.version)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--train-examples", type=int, default=8000, help="seeded sample of the predictor's training examples (default 8000)")
    parser.add_argument("--version", default="champion", help="registry version whose fine-tuned encoder is probed (default champion)")
    parser.add_argument("--max-input-tokens", type=int, default=256, help="tokens per prompt for every encoder (default 256)")
    parser.add_argument("--selection-examples", type=int, help="score on the first N selection prompts only (a quick look; default all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sets", help="comma-separated feature sets to probe (default all; e.g. 'serving last,backbone,predictor')")
    parser.add_argument("--features", type=Path, help="cache the features in this .npz (reused when its settings match)")
    args = parser.parse_args(argv)
    from app.runtime_env import process_defaults

    process_defaults()  # NOTE: a command of its own: offline hub, no MLflow telemetry
    if args.train_examples < 100:
        parser.error("--train-examples must be at least 100")
    if not 8 <= args.max_input_tokens <= 512:
        parser.error("--max-input-tokens must be within 8..512")
    if args.selection_examples is not None and args.selection_examples < 50:
        parser.error("--selection-examples must be at least 50 (5 folds)")
    sets = [x.strip() for x in args.sets.split(",")] if args.sets else None
    unknown = sorted(set(sets or ()) - set(SET_NAMES))
    if unknown:
        parser.error(f"--sets: unknown {unknown}; known: {', '.join(SET_NAMES)}")
    try:
        version = resolve_version(args.version)
    except (ValueError, RuntimeError) as exc:
        parser.error(f"--version: {exc}")
    report = run(args.train_examples, version, args.max_input_tokens, args.seed, args.selection_examples, args.features, sets)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
