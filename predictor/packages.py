"""The error for a missing data-only PyPI package (the model, the traces, the predictor backbone).

Here, on the predictor's side, so that ``predictor.model`` (the backbone) and ``app.prepare`` (the
model and the traces) raise the same error without the predictor importing the application."""

from __future__ import annotations


class MissingPackageError(RuntimeError):
    """A data package named in DESIGN.md is not installed."""
