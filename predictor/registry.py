"""MLflow tracking and model registry for the output-length predictor (alias ``champion`` serves).

A predictor directory (opaque files) is stored as the ``predictor`` artifact of a tiny pyfunc model registered
as ``length-predictor``; ``download_version`` brings it back, cached in ``<home>/mlflow/cache/<version>``.
The store is the one ``configure(store)`` was last given (process-wide, as MLflow's own tracking URI):
``store.tracking_uri``, else ``sqlite:///<home>/mlflow/mlflow.db`` with artifacts in ``<home>/mlflow/artifacts``.

Importing this module changes nothing outside it: MLflow's environment and loggers are set where a
process starts (``app.runtime_env.process_defaults``; ``MLFLOW_DISABLE_TELEMETRY`` must be set
before MLflow is first imported)."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from predictor.store import DOWNLOAD_MARKER, Store, bad_files, cached_copy

MODEL_NAME = "length-predictor"
CHAMPION = "champion"
EXPERIMENT = "length-predictor"
PREDICTOR_ARTIFACT = "predictor"  # key of the directory in the pyfunc model's artifacts
WITHIN1_GUARD = 0.02  # how much within-1-bucket accuracy a winner may lose
_MANIFEST_KEY = "predictor_manifest"  # MLmodel metadata: {relative path: size in bytes}

_clients: dict[str, MlflowClient] = {}  # tracking uri -> client whose experiment exists
_store: Store | None = None  # the store configure() last pointed MLflow at


class RegistryError(RuntimeError):
    """No champion, no such version, or the version's artifacts are missing or corrupt."""


class PredictorArtifact(mlflow.pyfunc.PythonModel):
    """Only a carrier so that MLflow stores the predictor directory; load it via ``download_version``."""

    _skip_type_hint_validation = True  # and no type hints on predict: else MLflow wraps it and warns

    def load_context(self, context: Any) -> None:
        self.predictor_dir = Path(context.artifacts[PREDICTOR_ARTIFACT])

    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError("load the predictor from predictor.registry.download_version()")


def _mkdir(path: Path) -> Path:
    (path := path.resolve()).mkdir(parents=True, exist_ok=True)
    return path


def configure(store: Store | None = None) -> MlflowClient:
    """Point MLflow tracking and registry at ``store`` (None: the store given last) and create the
    experiment if missing (cached per store). Raises ``RegistryError`` when no store was ever given."""
    global _store
    if store is None and (store := _store) is None:
        raise RegistryError("no predictor store configured: call predictor.registry.configure(store) first "
                            "(app.paths.predictor_store() is the data dir's)")
    resolved = store.uri()
    mlflow.set_tracking_uri(resolved)
    mlflow.set_registry_uri(resolved)
    _store = store
    if resolved in _clients:
        return _clients[resolved]
    client = MlflowClient(resolved, resolved)
    if client.get_experiment_by_name(EXPERIMENT) is None:
        root = store.artifact_root()  # a tracking server decides; local stores keep artifacts in the data dir
        artifact_root = _mkdir(root).as_uri() if root is not None else None
        try:
            client.create_experiment(EXPERIMENT, artifact_location=artifact_root)
        except MlflowException as e:  # another process created it meanwhile
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    _clients[resolved] = client
    return client


def tracking_uri() -> str:
    """The configured store's tracking URI."""
    configure()
    return _store.uri()


def start_run(params: dict[str, Any], tags: dict[str, Any] | None = None, run_name: str | None = None) -> str:
    """Open a training run in the experiment and log ``params``; returns the run id."""
    client = configure()
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    run = client.create_run(experiment_id, run_name=run_name, tags={k: str(v) for k, v in (tags or {}).items()})
    if params:
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])
    return run.info.run_id


def log_epoch(run_id: str, epoch: int, metrics: dict[str, float]) -> None:
    """Log one epoch's metrics with ``step=epoch``."""
    timestamp_ms = int(time.time() * 1000)
    configure().log_batch(run_id, metrics=[Metric(k, float(v), timestamp_ms, int(epoch)) for k, v in metrics.items()])


def log_eval_hash(run_id: str, eval_hash: str) -> None:
    """Record which eval set the run's metrics come from (param and tag ``eval_set_hash``)."""
    configure().log_batch(run_id, params=[Param("eval_set_hash", eval_hash)], tags=[RunTag("eval_set_hash", eval_hash)])


def fail_run(run_id: str) -> None:
    """End a run whose training failed (status FAILED), so that it does not stay RUNNING."""
    configure().set_terminated(run_id, "FAILED")


def finish_run(
    run_id: str, model_dir: Path, final_metrics: dict[str, float], tags: dict[str, Any] | None = None
) -> str:
    """Log ``final_metrics`` (one step past the last epoch) and ``model_dir``; register a version tagged with the run's
    tags (``source``, ``eval_set_hash``), ``tags`` and ``metric.<name>``; end the run (FAILED on error) -> version."""
    client = configure()
    model_dir = Path(model_dir).resolve()
    with mlflow.start_run(run_id=run_id):
        manifest = _manifest(model_dir)
        if tags:
            client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        step = 1 + max((m.step for k in final_metrics for m in client.get_metric_history(run_id, k)), default=-1)
        mlflow.log_metrics({k: float(v) for k, v in final_metrics.items()}, step=step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            info = mlflow.pyfunc.log_model(  # pip_requirements=[]: no environment inference (it calls pip)
                name="model", python_model=PredictorArtifact(), artifacts={PREDICTOR_ARTIFACT: str(model_dir)},
                pip_requirements=[], metadata={_MANIFEST_KEY: manifest})
        version_tags = {k: v for k, v in client.get_run(run_id).data.tags.items() if not k.startswith("mlflow.")}
        version_tags.update({f"metric.{k}": repr(float(v)) for k, v in final_metrics.items()})
        try:  # not mlflow.register_model: it prints "Successfully registered model" to stderr
            client.create_registered_model(MODEL_NAME)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        mv = client.create_model_version(MODEL_NAME, info.model_uri, run_id, tags=version_tags, model_id=info.model_id)
    return str(mv.version)


def champion_version(client: MlflowClient | None = None) -> str | None:
    """The version the ``champion`` alias points at, or None."""
    try:
        return str((client or configure()).get_model_version_by_alias(MODEL_NAME, CHAMPION).version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def _get_version(version: str) -> tuple[MlflowClient, Any]:
    client = configure()
    try:
        return client, client.get_model_version(MODEL_NAME, str(version))
    except MlflowException as e:
        raise RegistryError(f"{MODEL_NAME} version {version} does not exist in {tracking_uri()}") from e


def _tag_metrics(tags: dict[str, str]) -> dict[str, float]:
    return {k.removeprefix("metric."): float(v) for k, v in tags.items() if k.startswith("metric.")}


def get_version_info(version: str) -> dict[str, Any]:
    """Version, run id, tags, run metrics (latest values), creation time, aliases and source."""
    client, mv = _get_version(version)
    metrics = dict(client.get_run(mv.run_id).data.metrics) if mv.run_id else _tag_metrics(mv.tags)
    return {**_describe(mv, list(mv.aliases)), "metrics": metrics, "source": mv.source}


def _describe(mv: Any, aliases: list[str]) -> dict[str, Any]:
    return {"version": str(mv.version), "run_id": mv.run_id, "tags": dict(mv.tags), "aliases": aliases,
            "metrics": _tag_metrics(mv.tags), "created_unix_s": mv.creation_timestamp / 1000.0}


def list_versions() -> list[dict[str, Any]]:
    """All versions, newest first: version, aliases, tags, metrics (from ``metric.*`` tags), run id."""
    client = configure()
    versions = client.search_model_versions(f"name='{MODEL_NAME}'")
    aliases: dict[str, list[str]] = {}  # search_model_versions leaves ModelVersion.aliases empty
    for alias, version in (client.get_registered_model(MODEL_NAME).aliases if versions else {}).items():
        aliases.setdefault(str(version), []).append(alias)
    newest_first = sorted(versions, key=lambda mv: int(mv.version), reverse=True)
    return [_describe(mv, aliases.get(str(mv.version), [])) for mv in newest_first]


def model_tag(key: str, client: MlflowClient | None = None) -> str | None:
    """The registered model's tag ``key`` (None when unset or before the first version)."""
    try:
        return (client or configure()).get_registered_model(MODEL_NAME).tags.get(key)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
            return None
        raise


def set_model_tag(key: str, value: str, client: MlflowClient | None = None) -> None:
    """Set the registered model's tag ``key``: state every node reads from the one registry."""
    (client or configure()).set_registered_model_tag(MODEL_NAME, key, value)


def set_champion(version: str) -> None:
    """Move the ``champion`` alias to ``version``."""
    client, mv = _get_version(version)
    client.set_registered_model_alias(MODEL_NAME, CHAMPION, str(mv.version))


def gate(
    candidate: dict[str, float], champion: dict[str, float] | None, primary: str = "kendall_tau", min_gain: float = 0.0
) -> tuple[bool, str]:
    """The promotion gate (pure): accept when there is no champion, or when the candidate beats it on
    ``primary`` by more than ``min_gain`` and loses at most 0.02 within-1-bucket accuracy. Both dicts
    must come from the same eval set. Returns (accepted, human-readable reason)."""
    if champion is None:
        return True, "no champion yet"
    guard = "within1_bucket_acc"
    for who, metrics in (("candidate", candidate), ("champion", champion)):
        if missing := [k for k in (primary, guard) if k not in metrics]:
            raise ValueError(f"{who} metrics lack {missing}")
    (cand, champ), (cand_w1, champ_w1) = [(float(candidate[k]), float(champion[k])) for k in (primary, guard)]
    if not cand > champ + min_gain:
        return False, f"{primary} {cand:.4f} does not beat champion {champ:.4f} + {min_gain:g}"
    if not cand_w1 >= champ_w1 - WITHIN1_GUARD:
        return False, f"{guard} {cand_w1:.4f} is more than {WITHIN1_GUARD} below champion {champ_w1:.4f}"
    return True, f"{primary} {cand:.4f} > {champ:.4f} + {min_gain:g}; {guard} {cand_w1:.4f} vs {champ_w1:.4f}"


def promote_if_better(
    version: str, candidate_metrics: dict[str, float], champion_metrics: dict[str, float] | None, eval_hash: str
) -> tuple[bool, str]:
    """Gate ``version``, move the alias if accepted, tag ``gate``, ``gate_reason``, ``gate_eval_set_hash``.
    Both dicts must come from eval set ``eval_hash``: passing the version's recorded final metrics while its
    ``eval_set_hash`` tag differs is rejected. ``champion_metrics=None`` means no usable champion: accepted."""
    client, mv = _get_version(version)
    stored, trained_on = _tag_metrics(mv.tags), mv.tags.get("eval_set_hash")
    if trained_on not in (None, eval_hash) and all(stored.get(k) == float(v) for k, v in candidate_metrics.items()):
        accepted, reason = False, f"eval set mismatch: v{mv.version}'s metrics are on {trained_on}, not {eval_hash}"
    elif (current := champion_version(client)) == str(mv.version):
        accepted, reason = True, "already champion"
    else:
        accepted, reason = gate(candidate_metrics, champion_metrics)
        if champion_metrics is None and current is not None:
            reason = f"champion v{current} could not be evaluated; a working candidate replaces it"
    if accepted:
        client.set_registered_model_alias(MODEL_NAME, CHAMPION, str(mv.version))
    decision = {"gate": "accepted" if accepted else "rejected", "gate_reason": reason, "gate_eval_set_hash": eval_hash}
    for key, value in decision.items():
        client.set_model_version_tag(MODEL_NAME, str(mv.version), key, value)
    return accepted, reason


def download_version(version: str | None = None) -> tuple[Path, str]:
    """Local directory of the predictor files of ``version`` (None: the champion), and the version.
    Repeat calls return the cached copy after a size check; a damaged cache entry is fetched again."""
    if version is None and (version := champion_version()) is None:
        hint = "run `foreserve predictor train` or `foreserve prepare`"
        raise RegistryError(f"no champion version of {MODEL_NAME} in {tracking_uri()}; {hint}")
    mv = _get_version(version)[1]
    version = str(mv.version)
    cache = _store.cache_dir(version)  # NOTE: the store _get_version configured
    if (cached := cached_copy(cache, mv.source)) is not None:
        return cached, version
    tmp = _mkdir(cache.parent) / f".tmp-{version}-{uuid.uuid4().hex}"
    try:
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{MODEL_NAME}/{version}", dst_path=str(tmp))
            model = mlflow.models.Model.load(str(tmp))
        except Exception as e:
            raise RegistryError(f"artifacts of {MODEL_NAME} v{version} ({mv.source}) are unreadable: {e}") from e
        artifact = model.flavors.get("python_function", {}).get("artifacts", {}).get(PREDICTOR_ARTIFACT, {})
        manifest = (model.metadata or {}).get(_MANIFEST_KEY)
        if not artifact.get("path") or not manifest:
            raise RegistryError(f"{MODEL_NAME} v{version} is not a foreserve predictor (no '{PREDICTOR_ARTIFACT}')")
        if bad := bad_files(tmp / artifact["path"], manifest):
            raise RegistryError(f"{MODEL_NAME} v{version} ({mv.source}): files missing or truncated: {bad[:5]}")
        marker = {"source": mv.source, "predictor": artifact["path"], "manifest": manifest}
        (tmp / DOWNLOAD_MARKER).write_text(json.dumps(marker))
        try:
            tmp.rename(cache)
        except OSError:  # an entry is there: another process's good copy (keep it) or a stale one
            if cached_copy(cache, mv.source) is None:
                shutil.rmtree(cache, ignore_errors=True)
                with contextlib.suppress(OSError):  # lost the race to another repair: checked below
                    tmp.rename(cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if (cached := cached_copy(cache, mv.source)) is None:
        raise RegistryError(f"cache entry {cache} of {MODEL_NAME} v{version} is unusable")
    return cached, version


def _manifest(model_dir: Path) -> dict[str, int]:
    """{relative path: size in bytes} of every file under ``model_dir``."""
    files = [p for p in model_dir.rglob("*") if p.is_file()] if model_dir.is_dir() else []
    if not files:
        raise ValueError(f"model dir {model_dir} is missing or empty")
    return {p.relative_to(model_dir).as_posix(): p.stat().st_size for p in files}
