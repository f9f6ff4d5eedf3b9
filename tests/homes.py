"""Private data dirs for tests that start a service: the prepared model and traces linked in, read-only."""

from __future__ import annotations

from pathlib import Path


def link_prepared(home: Path) -> Path:
    """``home`` (created) with the prepared model and traces linked in: a service started there serves
    the model, and a load test draws its prompts from the traces (which it would otherwise build again,
    two minutes here). Call it before FORESERVE_HOME points at ``home``: it reads the prepared ones."""
    from app import paths

    model, traces = paths.model_dir(), paths.traces_dir()
    (home / "models").mkdir(parents=True)
    (home / "models" / model.name).symlink_to(model)
    (home / "traces").symlink_to(traces)
    return home
