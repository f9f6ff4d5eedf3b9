"""The Makefile's environment for what it runs: bytecode written once, under the venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python_under_make(env: dict[str, str]) -> dict:
    """What a Python process started by one of the Makefile's recipes sees of bytecode."""
    probe = "import json, sys; print(json.dumps({'dont_write': sys.dont_write_bytecode, 'prefix': sys.pycache_prefix}))"
    recipe = f"probe:\n\t@{sys.executable} -c \"{probe}\""
    proc = subprocess.run(["make", "--no-print-directory", "-s", "-f", "Makefile", "--eval", recipe, "probe"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_recipes_write_bytecode_under_the_venv_even_where_the_environment_forbids_it():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    seen = _python_under_make({**env, "PYTHONDONTWRITEBYTECODE": "1"})
    assert seen == {"dont_write": False, "prefix": str(ROOT / ".venv" / "pycache")}


def test_a_prefix_of_the_users_own_is_kept():
    seen = _python_under_make({**os.environ, "PYTHONPYCACHEPREFIX": "/tmp/elsewhere"})
    assert seen["prefix"] == "/tmp/elsewhere"
