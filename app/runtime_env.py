"""The environment a foreserve process hands on to the processes it starts (Serve replicas, batch
jobs, tensor-parallel rank actors): named once here, read only where a process is started; and the
defaults every foreserve process sets once, where it starts (``process_defaults``)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.config import EngineConfig

# Every child: the same data dir and registry, an offline hub, quiet tokenizers, no telemetry.
PROCESS_ENV = ("FORESERVE_HOME", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "MLFLOW_DISABLE_TELEMETRY",
               "MLFLOW_TRACKING_URI", "FORESERVE_STORE")
# Serve replicas also get the API keys' digests (never the keys: deployments.launch turns
# FORESERVE_API_KEYS into FORESERVE_API_KEY_SHA256) and the step trace switch.
SERVE_ENV = PROCESS_ENV + ("FORESERVE_API_KEY_SHA256", "FORESERVE_STEP_TRACE")
# A batch job's driver joins the cluster itself: it gets the auth mode, never the token (a runtime_env
# is shown in the dashboard; the driver runs on a node of the cluster, which has the token already).
JOB_ENV = PROCESS_ENV + ("RAY_AUTH_MODE",)


def process_defaults() -> None:
    """Offline hub, quiet tokenizers, no MLflow telemetry or progress bars, quiet MLflow loggers: set
    once, where a process starts (the CLI, a Serve replica, a batch job, a retraining task), before
    Hugging Face's or MLflow's libraries are imported (they read these then). Nothing sets them at
    import; a value already in the environment wins. Calling it again changes nothing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no phoning home from an offline machine
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("mlflow.pyfunc").addFilter(_no_cloudpickle_notes)  # NOTE: added once (same object)


def _no_cloudpickle_notes(record: logging.LogRecord) -> bool:
    """MLflow's note that a pyfunc model is pickled with CloudPickle: every registered version logs it."""
    return "CloudPickle" not in record.getMessage()


def step_trace_folder() -> str | None:
    """The folder ``FORESERVE_STEP_TRACE`` names (the switch `foreserve serve` forwards to every
    replica), or None."""
    return os.environ.get("FORESERVE_STEP_TRACE") or None


def traced(config: EngineConfig) -> EngineConfig:
    """``config`` with its step trace on when ``FORESERVE_STEP_TRACE`` names a folder; the engine
    itself reads no environment."""
    folder = step_trace_folder()
    return config.model_copy(update={"step_trace_dir": folder}) if folder else config


def env_vars(names: tuple[str, ...]) -> dict[str, str]:
    """Those of ``names`` that are set in this process, for a runtime_env's ``env_vars``."""
    return {k: os.environ[k] for k in names if k in os.environ}
