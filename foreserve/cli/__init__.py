"""The ``foreserve`` command: one module per command group, assembled in ``main.py``."""

from foreserve.cli.main import main

__all__ = ["main"]
