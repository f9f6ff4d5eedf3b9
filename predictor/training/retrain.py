"""S3's fault handling, closed: the engine's real lengths retrain the predictor.

A trigger fires every ``every_records`` new feedback records, or as soon as the recent
misprediction rate passes a threshold. Retraining continues from the champion on the feedback
(plus a sample of the original ShareGPT data, so it does not forget), is gated on a held-out slice
of the feedback (the serving model's own lengths) and promoted if it wins. ``submit_retrain`` runs
it as a Ray task, which the serving app calls on a timer.

The feedback folder, the registry's store and the traces' folder are arguments: the entry points
(the CLI, the predictor deployment) fill them from the data dir (``app.paths``).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

from predictor.buckets import LengthBuckets
from predictor.config import RetrainPolicy
from predictor.feedback import FeedbackRecord, scan_feedback
from predictor.object_store import ObjectStore
from predictor.store import Store
from predictor.training.dataset import Example, feedback_examples, is_censored, trace_examples

logger = logging.getLogger(__name__)
WATERMARK_TAG = "retrain_watermark_s"  # a registered-model tag: feedback up to here has retrained


def is_holdout(text: str, frac: float) -> bool:
    """Deterministic by prompt text, so one prompt never lands on both sides."""
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def mispredicted(record: FeedbackRecord, buckets: LengthBuckets) -> bool:
    """The bound overflowed, or the length landed more than one bucket off the prediction. An answer
    cut by its own max_tokens was at least that long, so it can only show a prediction too short."""
    if record.predicted_bound_tokens is not None and record.output_tokens > record.predicted_bound_tokens:
        return True
    if record.predicted_bucket is None:
        return False
    gap = buckets.bucket_of(min(record.output_tokens, buckets.max_tokens)) - record.predicted_bucket
    return gap > 1 if is_censored(record, buckets.max_tokens) else abs(gap) > 1


def last_retrain_s(client=None) -> float:
    """When the last retraining began (its feedback scan), from the registry: the registered
    model's tag ``retrain_watermark_s``, which every node reads alike. 0 before the first."""
    from predictor import registry

    try:
        return float(registry.model_tag(WATERMARK_TAG, client) or 0.0)
    except ValueError:
        return 0.0


def mark_retrained(when_s: float | None = None, client=None) -> None:
    """Move the watermark: records up to ``when_s`` (now when None) have had their retraining."""
    from predictor import registry

    registry.set_model_tag(WATERMARK_TAG, repr(when_s if when_s is not None else time.time()), client)


def trigger_reason(records: list[FeedbackRecord], policy: RetrainPolicy, buckets: LengthBuckets) -> str | None:
    """Why to retrain on these new records now, or None. Only labels (``feedback_examples``) count
    toward ``min_records`` and ``every_records``; the misprediction window also takes answers cut by
    their own short max_tokens, which can show a prediction too short."""
    usable = [r for r in records if r.finish_reason in ("stop", "length") and not r.ignore_eos]
    labels = len(feedback_examples(usable, buckets.max_tokens))
    if labels < policy.min_records:
        return None
    if labels >= policy.every_records:
        return f"{labels} new labelled feedback records (every {policy.every_records})"
    window = sorted(usable, key=lambda r: r.timestamp_s)[-policy.window_records :]  # across all writers' files
    rate = sum(mispredicted(r, buckets) for r in window) / len(window)
    if rate > policy.mispredict_rate:
        return f"misprediction rate {rate:.2f} over the last {len(window)} records > {policy.mispredict_rate}"
    return None


def records_since_last_retrain(records: list[FeedbackRecord], since_s: float) -> list[FeedbackRecord]:
    return [r for r in records if r.timestamp_s > since_s]


def retrain_due(policy: RetrainPolicy, spec, root: ObjectStore | Path, store: Store) -> str | None:
    """Why the feedback written since the last retraining calls for another one now, or None."""
    from predictor import registry

    since_s = last_retrain_s(registry.configure(store))
    return trigger_reason(records_since_last_retrain(scan_feedback(root)[0], since_s), policy, spec.buckets)


def split_feedback(records: list[FeedbackRecord], policy: RetrainPolicy, max_tokens: int) -> tuple[list[Example], list[Example]]:
    examples = feedback_examples(records, max_tokens)
    train = [e for e in examples if not is_holdout(e.text, policy.holdout_frac)]
    holdout = [e for e in examples if is_holdout(e.text, policy.holdout_frac)]
    return train, holdout


def retrain_from_feedback(policy: RetrainPolicy, root: ObjectStore | Path, force: bool = False, promote: bool = True, *,
                          store: Store, trace_dir: Path | None = None) -> dict:
    """Check the trigger on the feedback in ``root`` (unless ``force``), then retrain, register
    (``source=feedback``) in ``store``, gate and promote. ``trace_dir``: the traces whose train split
    is mixed in (``policy.original_examples``). Returns a summary; ``{"retrained": False,
    "reason": ...}`` when nothing to do."""
    from predictor import registry
    from predictor.training import pipeline
    from predictor.model import META, LengthModel, ModelSpec
    from predictor.training.train import TrainConfig

    if policy.original_examples and trace_dir is None:
        raise ValueError("mixing original examples in (retrain.original_examples) needs the traces' folder")
    registry.configure(store)
    started_s = time.time()  # NOTE: before the scan: a record written during it counts next time
    records, skipped = scan_feedback(root)
    new = records if force else records_since_last_retrain(records, last_retrain_s())
    directory, version = registry.download_version()  # cached: no weights loaded unless we retrain
    spec = ModelSpec.model_validate_json((directory / META).read_text())
    reason = "forced" if force else trigger_reason(new, policy, spec.buckets)
    if reason is None:
        return {"retrained": False, "reason": f"trigger not met ({len(new)} new records)", "skipped_lines": skipped}
    train, holdout = split_feedback(records, policy, spec.max_tokens)
    if not train or len(holdout) < 5:
        return {"retrained": False, "reason": f"too little usable feedback ({len(train)} train, {len(holdout)} held out)"}
    original = trace_examples(trace_dir, "train") if policy.original_examples else []
    random.Random(0).shuffle(original)
    mix = train + original[: policy.original_examples]
    config = TrainConfig(epochs=policy.epochs, lr=policy.lr, warmup_frac=0.0)
    summary = pipeline.train_and_register(
        config, spec, train=mix, evalset=holdout, source="feedback", promote=promote and policy.gate, store=store,
        init=LengthModel.load(directory),
        extra_params={"feedback_train": len(train), "feedback_holdout": len(holdout), "parent_version": version, "trigger": reason},
    )
    if promote and not policy.gate:
        registry.set_champion(summary["version"])
        summary.update(promoted=True, gate="skipped (retrain.gate is false)")
    mark_retrained(started_s)
    logger.info("retrained predictor: %s", summary)
    return {"retrained": True, "reason": reason, "parent_version": version, **summary}


def _retrain_task(policy: RetrainPolicy, root: ObjectStore | Path, force: bool, store: Store, trace_dir: Path | None,
                  setup: Callable[[], None] | None) -> dict:
    """The Ray task's body: a process of its own, so it runs the caller's ``setup`` first (the
    process defaults: offline hub, quiet loggers)."""
    if setup is not None:
        setup()
    return retrain_from_feedback(policy, root, force, store=store, trace_dir=trace_dir)


def submit_retrain(policy: RetrainPolicy, root: ObjectStore | Path, force: bool = False, *, store: Store,
                   trace_dir: Path | None = None, setup: Callable[[], None] | None = None):
    """Run ``retrain_from_feedback`` as a Ray task (``policy.num_cpus``); returns its ObjectRef.
    ``setup`` runs first in the task's process."""
    import ray

    task = ray.remote(num_cpus=policy.num_cpus, max_retries=0)(_retrain_task)
    return task.remote(policy, root, force, store, trace_dir, setup)
