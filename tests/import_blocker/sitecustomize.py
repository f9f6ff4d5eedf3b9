"""Make some top-level modules look uninstalled, in this process and every Python child it starts.

``make test-unit`` puts this folder first on PYTHONPATH and names the modules in
FORESERVE_BLOCK_IMPORTS (comma-separated). Python imports ``sitecustomize`` at start-up, before pytest
or any plugin, so in the unit tier, subprocesses included, those modules are as on a machine without
them: ``import ray`` raises ModuleNotFoundError and ``importlib.util.find_spec("mlflow")`` is None
(so optional probes, e.g. accelerate's ``is_mlflow_available()``, say no instead of crashing).
Without the variable this file does nothing.
"""

from __future__ import annotations

import os
import sys

ENV = "FORESERVE_BLOCK_IMPORTS"


class HidingFinder:
    """Wraps one meta-path finder; finds nothing for the hidden top-level modules (and their
    submodules), and defers everything else to the finder it wraps."""

    def __init__(self, inner, names: frozenset[str]) -> None:
        self.inner = inner
        self.names = names

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            return None
        return self.inner.find_spec(fullname, path, target)

    def __getattr__(self, attr: str):  # invalidate_caches, find_distributions, ...
        return getattr(self.inner, attr)

    def __repr__(self) -> str:
        return f"HidingFinder({self.inner!r}, hiding {sorted(self.names)})"


def install() -> frozenset[str]:
    names = frozenset(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip())
    if names:
        sys.meta_path[:] = [f if isinstance(f, HidingFinder) else HidingFinder(f, names) for f in sys.meta_path]
    return names


install()
