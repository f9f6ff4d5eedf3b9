"""Shared fixtures, and the rules of the three tiers.

tests/unit   no model, no prepared data, no Ray, MLflow or Locust: runs on `make install` alone.
             `make test-unit` proves it: an empty FORESERVE_HOME, and those packages (and the data
             packages the model and traces are prepared from) hidden by tests/import_blocker.
tests/model  the real SmolLM2 weights or the ShareGPT traces that `make prepare` writes (markers
             ``model``, ``traces``); no Ray, MLflow, Locust or DeepSpeed rank processes.
tests/e2e    Ray or Serve, MLflow, Locust, DeepSpeed's rank processes (markers ``ray``, ``mlflow``,
             ``locust``, ``deepspeed``), often with the model or traces too.

A test's markers say what it needs (registered in pyproject.toml); the collection check below fails
the run when a test sits in a tier its markers rule out, so a marker and a folder cannot drift apart.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
NEEDS = ("model", "traces", "ray", "mlflow", "locust", "deepspeed")
# tier -> (markers a test there must carry at least one of, markers it must not carry)
TIERS = {
    "unit": ((), NEEDS),
    "model": (("model", "traces"), ("ray", "mlflow", "locust", "deepspeed")),
    "e2e": (("ray", "mlflow", "locust", "deepspeed"), ()),
}
BLOCK_ENV = "FORESERVE_BLOCK_IMPORTS"


def blocked_modules() -> set[str]:
    """The modules `make test-unit` hides (tests/import_blocker/sitecustomize.py), if it does."""
    return {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}


def pytest_configure(config: pytest.Config) -> None:
    blocked = blocked_modules()
    if not blocked:
        return
    hider = sys.modules.get("sitecustomize")
    if not hasattr(hider, "HidingFinder"):
        raise pytest.UsageError(f"{BLOCK_ENV} is set but nothing hides those modules: put tests/import_blocker "
                                "first on PYTHONPATH, as `make test-unit` does")
    hider.install()  # again: pytest put its assertion-rewriting import hook in front since start-up
    assert all(isinstance(f, hider.HidingFinder) for f in sys.meta_path)
    loaded = sorted(n for n in blocked if n in sys.modules)
    if loaded:
        raise pytest.UsageError(f"{', '.join(loaded)} imported before the blocker: disable the plugin that imports it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        try:
            tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue  # not under tests/
        if tier not in TIERS:
            wrong.append(f"{item.nodeid}: outside tests/unit, tests/model and tests/e2e")
            continue
        need_one, forbidden = TIERS[tier]
        marks = {m.name for m in item.iter_markers()}
        if need_one and not marks & set(need_one):
            wrong.append(f"{item.nodeid}: in tests/{tier} without any of the markers {', '.join(need_one)}")
        if marks & set(forbidden):
            wrong.append(f"{item.nodeid}: in tests/{tier} but marked {', '.join(sorted(marks & set(forbidden)))}")
    if wrong:
        raise pytest.UsageError("tests in the wrong tier for their markers (see tests/conftest.py):\n  " + "\n  ".join(wrong))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private data dir (FORESERVE_HOME) with an empty MLflow store folder, and no tracking URI from
    the environment: what a test writes (predictor versions, feedback, reports) stays in it."""
    home = tmp_path / "home"
    (home / "mlflow").mkdir(parents=True)
    monkeypatch.setenv("FORESERVE_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home
