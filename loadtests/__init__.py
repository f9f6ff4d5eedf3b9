"""Load tests (Locust runs and their reports); benchmarks live in ``bench/``."""
