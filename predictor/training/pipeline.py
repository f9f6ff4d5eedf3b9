"""Train → log → register → gate → promote. The CLI and the retraining loop are thin layers over
these functions; loading what serves is ``predictor/loading.py`` (re-exported here).

Each function works on the registry ``store`` it is given and, where it reads the traces, on the
``trace_dir`` it is given: the entry points fill both from the data dir (``app.paths``)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from predictor import registry
from predictor.loading import load_predictor, load_predictor_or_max  # noqa: F401 - re-exported
from predictor.model import LengthModel, ModelSpec
from predictor.store import Store
from predictor.training.dataset import Example, examples_hash, selection_examples, training_examples
from predictor.training.metrics import METRICS
from predictor.training.train import TrainConfig, evaluate, train_model

logger = logging.getLogger(__name__)

# NOTE: the first champion must train in a few minutes on 2 CPU cores (`foreserve prepare`);
# `foreserve predictor train` with the defaults is the fuller run, promoted through the gate.
QUICK_TRAIN = TrainConfig(epochs=1, max_train_examples=4000)
QUICK_SPEC = ModelSpec(max_input_tokens=256)
# NOTE: every turn of the train conversations (43,807 examples) for 2 epochs at 256 input tokens
# (34 min here) beat first turns only for 3 epochs at 512 (tau 0.442 vs 0.414, same eval set).
FULL_TRAIN = TrainConfig(epochs=2)
FULL_SPEC = ModelSpec(max_input_tokens=256)


def _metrics_only(metrics: dict) -> dict[str, float]:
    return {k: float(metrics[k]) for k in METRICS if k in metrics}


def champion_metrics(evalset: list[Example], eval_hash: str, store: Store) -> dict[str, float] | None:
    """The champion's metrics on ``evalset``: stored ones when they were computed on the same
    set, else measured now. None when there is no champion (or it cannot be loaded)."""
    version = registry.champion_version(registry.configure(store))
    if version is None:
        return None
    try:
        tags = registry.get_version_info(version).get("tags", {})
        if tags.get("eval_set_hash") == eval_hash and all(f"metric.{k}" in tags for k in METRICS):
            return {k: float(tags[f"metric.{k}"]) for k in METRICS}
        return _metrics_only(evaluate(load_predictor(version, store=store), evalset))
    except Exception as exc:  # noqa: BLE001 - a broken champion loses to any working candidate
        logger.error("champion v%s cannot be evaluated (%s); treating it as absent", version, exc)
        return None


def train_and_register(
    config: TrainConfig,
    spec: ModelSpec,
    train: list[Example] | None = None,
    evalset: list[Example] | None = None,
    source: str = "sharegpt",
    init: tuple[LengthModel, object] | None = None,
    promote: bool = True,
    extra_params: dict | None = None,
    turns: str = "first",
    *,
    store: Store,
    trace_dir: Path | None = None,
) -> dict:
    """Train, log every epoch to MLflow, register a version in ``store``, gate it against the
    champion on the same eval set, promote it if it wins. Returns a summary dict. Without
    ``train``, the train split of the traces in ``trace_dir``: first turns, or with ``turns="all"``
    the later turns too; without ``evalset``, their selection set."""
    if (train is None or evalset is None) and trace_dir is None:
        raise ValueError("training or evaluating on the traces needs their folder (trace_dir)")
    if train is None:
        train, extra_params = training_examples(trace_dir, turns), {**(extra_params or {}), "turns": turns}
    evalset = evalset if evalset is not None else selection_examples(trace_dir)
    eval_hash = examples_hash(evalset)
    params = {**config.model_dump(), **spec.model_dump(), "train_examples": len(train),
              "eval_examples": len(evalset), "source": source, **(extra_params or {})}
    registry.configure(store)
    run_id = registry.start_run(params, tags={"source": source, "eval_set_hash": eval_hash})
    registry.log_eval_hash(run_id, eval_hash)
    t0 = time.perf_counter()
    try:
        model, tokenizer, history = train_model(
            train, evalset, spec, config, init=init,
            on_epoch=lambda epoch, metrics: registry.log_epoch(run_id, epoch, metrics),
        )
        final = _metrics_only(history[-1])
        with tempfile.TemporaryDirectory(prefix="length-predictor-") as tmp:
            model.save(Path(tmp) / "model", tokenizer)
            version = registry.finish_run(
                run_id, Path(tmp) / "model", {**final, "train_s": time.perf_counter() - t0},
                tags={"source": source, "eval_set_hash": eval_hash},
            )
    except BaseException:  # an error or Ctrl-C: the run ends FAILED instead of staying RUNNING
        registry.fail_run(run_id)
        raise
    summary = {"version": version, "run_id": run_id, "metrics": final, "eval_set_hash": eval_hash,
               "train_s": round(time.perf_counter() - t0, 1), "promoted": False, "gate": "not run"}
    if promote:
        incumbent = champion_metrics(evalset, eval_hash, store)
        accepted, reason = registry.promote_if_better(version, final, incumbent, eval_hash)
        summary.update(promoted=accepted, gate=reason, champion_metrics=incumbent)
    return summary


def ensure_champion(store: Store, trace_dir: Path) -> dict | None:
    """Train and promote a first, quick champion on the traces in ``trace_dir`` when the registry has
    none (``prepare``)."""
    if registry.champion_version(registry.configure(store)) is not None:
        return None
    return train_and_register(QUICK_TRAIN, QUICK_SPEC, extra_params={"recipe": "quick"}, store=store, trace_dir=trace_dir)
