"""Train → MLflow → champion → serve, on a private store: the CLI, the engine fallback, retraining
from feedback (tiny data, real MiniLM backbone, real sqlite MLflow store)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from app import paths
from foreserve.cli.main import main
from predictor import registry
from predictor.base import MaxPredictor
from predictor.feedback import FeedbackRecord, FeedbackWriter
from predictor.learned import LearnedPredictor
from predictor.training.pipeline import load_predictor, load_predictor_or_max, train_and_register
from predictor.training.retrain import RetrainPolicy, retrain_from_feedback
from tests.tiny_predictor import CONFIG, EVAL, SPEC, TRAIN

# every test on a private data dir and MLflow store: the ``home`` fixture (tests/conftest.py)
pytestmark = [pytest.mark.mlflow, pytest.mark.usefixtures("home"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_train_register_promote_and_serve(home: Path, tmp_path: Path, capsys):
    first = train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
    assert first["version"] == "1" and first["promoted"] and registry.champion_version() == "1"
    run = MlflowClient().get_run(first["run_id"])
    assert run.data.params["eval_set_hash"] == first["eval_set_hash"]
    assert {"exact_bucket_acc", "within1_bucket_acc", "kendall_tau", "mae_tokens", "under_prediction_rate"} <= set(run.data.metrics)

    # the alias resolves through MLflow's own URI scheme as well as through our loader
    assert mlflow.artifacts.download_artifacts("models:/length-predictor@champion", dst_path=str(tmp_path / "dl"))
    served = load_predictor("champion", store=paths.predictor_store())
    assert isinstance(served, LearnedPredictor) and served.version == "1"
    assert len(served.predict(["hi", "write a story"]).bound_tokens) == 2

    # the same recipe again ties the champion: the gate keeps v1
    second = train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
    assert second["version"] == "2" and not second["promoted"] and registry.champion_version() == "1"

    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.text, "output_tokens": e.output_tokens}) + "\n" for e in EVAL))
    out = tmp_path / "eval.json"
    assert main(["predictor", "eval", "--data", str(data), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 12 and result["version"] == "1"
    assert set(result) >= {"n", "exact_bucket_acc", "within1_bucket_acc", "kendall_tau", "mae_tokens", "under_prediction_rate"}
    assert main(["predictor", "list"]) == 0
    listing = capsys.readouterr().out
    assert "champion" in listing and "rejected" in listing
    # bad input: one line and exit 2, never a traceback
    assert main(["predictor", "eval", "--data", str(data), "--version", "max"]) == 2
    assert main(["predictor", "eval", "--data", str(data), "--bound-quantile", "80"]) == 2
    assert main(["predictor", "promote", "9"]) == 2
    assert main(["predictor", "collect", "--prompts", "-1"]) == 2
    errors = capsys.readouterr().err
    assert "no learned predictor" in errors and "(0, 1]" in errors and "version 9 does not exist" in errors
    assert "--prompts must be >= 1" in errors

    # a training that fails leaves no run RUNNING
    with pytest.raises(ValueError, match="no training examples"):
        train_and_register(CONFIG, SPEC, train=[], evalset=EVAL, store=paths.predictor_store())
    runs = MlflowClient().search_runs([run.info.experiment_id], order_by=["start_time DESC"], max_results=1)
    assert runs[0].info.status == "FAILED"


def test_missing_or_corrupt_champion_falls_back_to_max(home: Path):
    with pytest.raises(registry.RegistryError, match="no champion"):
        load_predictor("champion", store=paths.predictor_store())
    assert isinstance(load_predictor_or_max("champion", store=paths.predictor_store()), MaxPredictor)
    train_and_register(CONFIG, SPEC, train=TRAIN[:8], evalset=EVAL[:4], store=paths.predictor_store())
    for f in (home / "mlflow").rglob("model.safetensors"):
        f.write_bytes(b"broken")
    fallback = load_predictor_or_max("champion", store=paths.predictor_store())
    assert isinstance(fallback, MaxPredictor) and fallback.version == "max-fallback"
    assert main(["predictor", "eval", "--data", "/nonexistent.jsonl"]) == 2


def test_retrain_from_feedback_registers_a_feedback_version(home: Path):
    traces = home / "traces"  # the "original data" mixed in: a train split of the tiny examples
    traces.mkdir()
    (traces / "train.jsonl").write_text("".join(json.dumps({"user": e.text, "output_tokens": e.output_tokens}) + "\n" for e in TRAIN))
    train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
    policy = RetrainPolicy(min_records=10, every_records=20, original_examples=8, holdout_frac=0.3, epochs=1)
    assert not retrain_from_feedback(policy, paths.feedback_dir(),
                                  store=paths.predictor_store(), trace_dir=traces)["retrained"]  # no feedback yet: the trigger does not fire
    with FeedbackWriter(paths.feedback_dir()) as writer:
        for i in range(40):
            long = i % 2 == 0
            writer.append(FeedbackRecord(
                request_id=f"r{i}", prompt=f"{'tell me everything about' if long else 'yes or no:'} topic {i}",
                predicted_bucket=0, predicted_bound_tokens=102, output_tokens=800 if long else 3,
                finish_reason="stop", tier="online", model_id="SmolLM2-135M-Instruct", predictor_version="1"))
    result = retrain_from_feedback(policy, paths.feedback_dir(), store=paths.predictor_store(), trace_dir=traces)
    assert result["retrained"] and result["version"] == "2" and result["parent_version"] == "1"
    assert "new labelled feedback records" in result["reason"]
    info = registry.get_version_info("2")
    assert info["tags"]["source"] == "feedback"
    # the watermark is in the registry, which every node reads, not beside one node's feedback
    assert float(registry.model_tag("retrain_watermark_s")) > 0 and not list(paths.feedback_dir().glob("*.json"))
    assert not retrain_from_feedback(policy, paths.feedback_dir(),
                                  store=paths.predictor_store(), trace_dir=traces)["retrained"]  # nothing new since


@pytest.mark.slow
@pytest.mark.ray
def test_retrain_runs_as_a_ray_task(home: Path):
    import ray

    from predictor.training.retrain import submit_retrain

    train_and_register(CONFIG, SPEC, train=TRAIN, evalset=EVAL, store=paths.predictor_store())
    with FeedbackWriter(paths.feedback_dir()) as writer:
        for i in range(30):
            writer.append(FeedbackRecord(request_id=f"r{i}", prompt=f"question {i} " + "more " * (i % 5),
                                         output_tokens=50 + 30 * (i % 5), finish_reason="stop", tier="online",
                                         model_id="m", predictor_version="1"))
    env = {"FORESERVE_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        policy = RetrainPolicy(min_records=10, every_records=20, original_examples=0, holdout_frac=0.3, epochs=1)
        result = ray.get(submit_retrain(policy, paths.feedback_dir(), store=paths.predictor_store()), timeout=300)
    finally:
        ray.shutdown()
    assert result["retrained"] and result["version"] == "2"
    assert registry.get_version_info("2")["tags"]["source"] == "feedback"
