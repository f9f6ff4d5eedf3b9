"""The MLflow registry layer on a private sqlite store per test: round trip, gate, aliases, errors, tags."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from predictor import registry
from predictor.registry import RegistryError
from predictor.store import Store

pytestmark = [pytest.mark.mlflow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # SQLAlchemy, inside MLflow

GOOD = {"kendall_tau": 0.60, "within1_bucket_acc": 0.80}


@pytest.fixture(scope="session")
def empty_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An initialised, empty MLflow sqlite file: creating the tables takes seconds, copying it does not."""
    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(autouse=True)
def home(home: Path, empty_db: Path) -> Path:
    """Each test gets its own data dir (tests/conftest.py's ``home``), hence its own store, artifacts
    and download cache; here the store starts as a copy of an initialised empty one."""
    shutil.copy(empty_db, home / "mlflow" / "mlflow.db")
    registry.configure(Store(home))
    return home


def make_model_dir(root: Path, seed: int = 0) -> Path:
    """A fake predictor: config, 'weights' and a tokenizer file in a subdirectory."""
    model_dir = root / f"predictor-{seed}"
    (model_dir / "tokenizer").mkdir(parents=True)
    (model_dir / "config.json").write_text(f'{{"num_buckets": 8, "seed": {seed}}}')
    (model_dir / "model.safetensors").write_bytes(os.urandom(4096 + seed))
    (model_dir / "tokenizer" / "tokenizer.json").write_text('{"vocab": {}}')
    return model_dir


def train(root: Path, metrics: dict[str, float], seed: int = 0, tags: dict | None = None, eval_hash: str = "h1") -> str:
    run_id = registry.start_run({"lr": 1e-4, "epochs": 2}, tags=tags, run_name=f"run-{seed}")
    registry.log_eval_hash(run_id, eval_hash)
    for epoch in range(2):
        registry.log_epoch(run_id, epoch, {"loss": 1.0 / (epoch + 1), "kendall_tau": metrics["kendall_tau"] - 0.1})
    return registry.finish_run(run_id, make_model_dir(root, seed), metrics)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_round_trip(home: Path, tmp_path: Path) -> None:
    client = registry.configure()
    assert registry.configure() is client  # cached
    assert registry.tracking_uri() == f"sqlite:///{(home / 'mlflow').resolve()}/mlflow.db"
    version = train(tmp_path, GOOD)
    assert version == "1"
    registry.set_champion("1")

    local_dir, resolved = registry.download_version()
    assert resolved == "1"
    assert files_of(local_dir) == files_of(tmp_path / "predictor-0")
    assert local_dir.is_relative_to(home / "mlflow" / "cache" / "1")
    assert registry.download_version("1") == (local_dir, "1")  # served from the cache

    # models:/length-predictor@champion resolves through plain MLflow too
    uri = f"models:/{registry.MODEL_NAME}@{registry.CHAMPION}"
    plain = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "plain")))
    assert (plain / "MLmodel").is_file()
    assert files_of(local_dir) == files_of(next(p for p in (plain / "artifacts").iterdir()))

    info = registry.get_version_info("1")
    assert info["aliases"] == ["champion"] and info["tags"]["eval_set_hash"] == "h1"
    assert info["metrics"]["kendall_tau"] == pytest.approx(0.60) and "loss" in info["metrics"]
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["eval_set_hash"] == "h1"
    assert [m.step for m in client.get_metric_history(info["run_id"], "loss")] == [0, 1]


def test_gate_and_promotion(tmp_path: Path) -> None:
    worse_tau = {"kendall_tau": 0.55, "within1_bucket_acc": 0.85}
    worse_within1 = {"kendall_tau": 0.70, "within1_bucket_acc": 0.70}
    better = {"kendall_tau": 0.65, "within1_bucket_acc": 0.79}
    assert registry.gate(GOOD, None) == (True, "no champion yet")
    assert registry.gate(worse_tau, GOOD)[0] is False
    accepted, reason = registry.gate(worse_within1, GOOD)
    assert not accepted and "within1_bucket_acc" in reason
    assert registry.gate(better, GOOD)[0] is True
    assert registry.gate(better, GOOD, min_gain=0.1)[0] is False
    with pytest.raises(ValueError, match="within1_bucket_acc"):
        registry.gate({"kendall_tau": 1.0}, GOOD)

    v1 = train(tmp_path, GOOD, seed=1)
    assert registry.promote_if_better(v1, GOOD, None, eval_hash="h1")[0]  # no champion yet
    assert registry.champion_version() == v1
    v2 = train(tmp_path, worse_within1, seed=2)
    assert not registry.promote_if_better(v2, worse_within1, GOOD, eval_hash="h1")[0]
    assert registry.champion_version() == v1
    tags = registry.get_version_info(v2)["tags"]
    assert tags["gate"] == "rejected" and "within1_bucket_acc" in tags["gate_reason"]
    v3 = train(tmp_path, better, seed=3)
    # v3's recorded metrics come from eval set h1: they cannot be compared on another set
    assert not registry.promote_if_better(v3, better, GOOD, eval_hash="other")[0]
    assert registry.get_version_info(v3)["tags"]["gate_reason"].startswith("eval set mismatch")
    # metrics measured afresh on the other set are gated normally
    assert not registry.promote_if_better(v3, worse_tau, GOOD, eval_hash="other")[0]
    assert "does not beat" in registry.get_version_info(v3)["tags"]["gate_reason"]
    assert registry.promote_if_better(v3, better, GOOD, eval_hash="h1") == (True, registry.gate(better, GOOD)[1])
    assert registry.champion_version() == v3
    assert registry.promote_if_better(v3, better, GOOD, eval_hash="h1") == (True, "already champion")
    assert registry.get_version_info(v3)["tags"]["gate"] == "accepted"
    assert registry.get_version_info(v3)["tags"]["gate_eval_set_hash"] == "h1"
    v4 = train(tmp_path, worse_tau, seed=4)  # the champion exists but could not be evaluated (None)
    accepted, reason = registry.promote_if_better(v4, worse_tau, None, eval_hash="h1")
    assert accepted and reason == f"champion v{v3} could not be evaluated; a working candidate replaces it"


def test_list_versions_newest_first(tmp_path: Path) -> None:
    assert registry.list_versions() == []
    for seed in range(3):
        train(tmp_path, GOOD, seed=seed)
    registry.set_champion("2")
    versions = registry.list_versions()
    assert [v["version"] for v in versions] == ["3", "2", "1"]
    assert [v["aliases"] for v in versions] == [[], ["champion"], []]
    assert versions[0]["metrics"] == pytest.approx(GOOD)
    registry.set_champion("3")  # the alias moves
    assert [v["aliases"] for v in registry.list_versions()] == [["champion"], [], []]


def test_errors(home: Path, tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="no champion version of length-predictor in sqlite:.*foreserve prepare"):
        registry.download_version()
    assert registry.champion_version() is None
    version = train(tmp_path, GOOD)
    with pytest.raises(RegistryError, match="no champion"):
        registry.download_version()
    with pytest.raises(RegistryError, match="version 7 does not exist"):
        registry.download_version("7")
    with pytest.raises(RegistryError, match="does not exist"):
        registry.set_champion("7")
    with pytest.raises(ValueError, match="missing or empty"):
        registry.finish_run(run_id := registry.start_run({}), tmp_path / "nowhere", GOOD)
    assert registry.configure().get_run(run_id).info.status == "FAILED"

    local_dir, _ = registry.download_version(version)
    (local_dir / "model.safetensors").unlink()  # a damaged cache entry is downloaded again
    assert registry.download_version(version)[0] == local_dir and (local_dir / "model.safetensors").is_file()

    stored = list((home / "mlflow" / "artifacts").rglob("model.safetensors"))
    assert len(stored) == 1
    stored[0].write_bytes(b"truncated")  # the store's copy is corrupt; the cached copy is gone
    shutil.rmtree(home / "mlflow" / "cache")
    with pytest.raises(RegistryError, match="missing or truncated.*model.safetensors"):
        registry.download_version(version)
    shutil.rmtree(stored[0].parents[2])  # the whole model's artifacts are gone
    with pytest.raises(RegistryError, match=f"v{version}"):
        registry.download_version(version)
    assert not (home / "mlflow" / "cache" / version).exists()


def test_concurrent_first_download_keeps_the_copy_already_there(home: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes miss the cache at once; the one that finishes second must not delete the
    first one's copy, which the first may be loading already."""
    version = train(tmp_path, GOOD)
    real = mlflow.artifacts.download_artifacts
    other: dict = {}

    def slow_download(**kwargs):
        out = real(**kwargs)
        if not other:  # meanwhile another process finishes its own download
            other["busy"] = True
            other["dir"] = registry.download_version(version)[0]
            other["inode"] = (other["dir"] / "model.safetensors").stat().st_ino
        return out

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", slow_download)
    local_dir, _ = registry.download_version(version)
    assert local_dir == other["dir"] and (local_dir / "model.safetensors").stat().st_ino == other["inode"]
    assert [p.name for p in (home / "mlflow" / "cache").iterdir()] == [version]  # no temp left behind


def test_tags_reach_the_version(tmp_path: Path) -> None:
    version = train(tmp_path, GOOD, tags={"source": "feedback"})
    run_id = registry.start_run({"lr": 1e-4})
    other = registry.finish_run(run_id, make_model_dir(tmp_path, 9), GOOD, tags={"source": "sharegpt", "n_rows": 10})
    assert registry.get_version_info(version)["tags"]["source"] == "feedback"
    tags = registry.get_version_info(other)["tags"]
    assert tags["source"] == "sharegpt" and tags["n_rows"] == "10"
    assert float(tags["metric.kendall_tau"]) == GOOD["kendall_tau"]
    assert not any(k.startswith("mlflow.") for k in tags)


def test_lookup_in_an_unchanged_store_needs_no_mlflow(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``predictor.loading`` answers a repeated lookup from its record while the sqlite store is
    unchanged; a promotion changes the store, so the next lookup asks MLflow again."""
    from predictor import loading

    def register(seed: int) -> str:
        model_dir = make_model_dir(tmp_path, seed)
        (model_dir / "predictor.json").write_text("{}")
        run_id = registry.start_run({"seed": seed}, run_name=f"run-{seed}")
        return registry.finish_run(run_id, model_dir, GOOD)

    registry.set_champion(register(0))
    lookups: list[str | None] = []
    real = registry.download_version
    monkeypatch.setattr(registry, "download_version", lambda version=None: lookups.append(version) or real(version))
    store = Store(home)
    first = loading._registry_copy("champion", store)
    assert first[1] == "1" and lookups == [None]
    assert loading._registry_copy("champion", store) == first and lookups == [None]  # from the record
    registry.set_champion(register(1))
    directory, version = loading._registry_copy("champion", store)
    assert version == "2" and lookups == [None, None] and (directory / "predictor.json").is_file()
    (directory / "model.safetensors").write_bytes(b"cut")  # a damaged copy is no hit: the registry repairs it
    assert loading._registry_copy("champion", store) == (directory, "2") and lookups == [None, None, None]
    assert (directory / "model.safetensors").stat().st_size > 3
    assert loading._store_state(Store(home, "http://mlflow.example:5000")) is None  # a remote store is always asked
