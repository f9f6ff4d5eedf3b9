"""The fake model is deterministic across processes: its tokens do not depend on PYTHONHASHSEED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One process's view: the fake model's token table, the tokens of whole engine runs on it, and what
# the salted hash() says (the control: it must differ between the two processes, or the check is moot).
SCRIPT = """
import json
from tests.engine_helpers import add, make_engine, run_all
from tests.fake_runner import FakeRunner

table = {f"{rid}:{pos}": FakeRunner.token_for(rid, pos) for rid in ("a", "b", "req-17") for pos in range(64)}
engine = make_engine("paged", "fcfs", kv_tokens=256)
for i, (prompt, out) in enumerate([(12, 9), (30, 20), (5, 33)]):
    add(engine, f"r{i}", prompt, out)
runs = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in run_all(engine).items()}
print(json.dumps({"table": table, "runs": runs, "salted": hash("req-17")}))
"""


def _run(seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tokens_are_the_same_under_any_hash_seed():
    one, two = _run("1"), _run("2")
    assert one["salted"] != two["salted"]  # the two processes really hash strings differently
    assert one["table"] == two["table"]
    assert one["runs"] == two["runs"]
    assert sorted(one["runs"]) == ["r0", "r1", "r2"] and [len(one["runs"][r]) for r in ("r0", "r1", "r2")] == [9, 20, 33]
    assert len(set(one["table"].values())) > 100  # a spread of tokens, not a constant
