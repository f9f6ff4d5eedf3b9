"""Research probes, not packaged: run from the repository root as ``python -m scripts.<name>``."""
