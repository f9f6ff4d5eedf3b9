"""A local Ray cluster that died uncleanly: its current-cluster file still names a GCS nobody
answers at. foreserve notices in seconds and starts a fresh local cluster (``app/ray_local.py``)
where ``ray.init()`` alone would retry the dead one for minutes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket closes


def test_the_probe_tells_a_dead_cluster_from_a_live_one(tmp_path, monkeypatch):
    from app.ray_local import dead_local_cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert dead_local_cluster(str(tmp_path)) is None  # no file: nothing to join
    dead = f"127.0.0.1:{_closed_port()}"
    (tmp_path / "ray_current_cluster").write_text(dead + "\n")
    assert dead_local_cluster(str(tmp_path)) == dead  # a refused connection: no GCS retries
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        (tmp_path / "ray_current_cluster").write_text(f"127.0.0.1:{live.getsockname()[1]}")
        assert dead_local_cluster(str(tmp_path)) is None
        monkeypatch.setenv("RAY_ADDRESS", dead)
        assert dead_local_cluster(str(tmp_path)) is None  # the user chose a cluster: not ours to second-guess


def test_a_command_after_a_crashed_cluster_starts_a_fresh_one(tmp_path):
    """The file left by a dead cluster, as a crash leaves it; ``init_local`` starts a new local
    cluster in seconds and says why, in a process of its own (its own Ray temp dir)."""
    ray_tmp = Path(f"/tmp/fsr-{os.getpid()}")  # NOTE: short: Ray's socket paths live under it
    (ray_tmp / "ray").mkdir(parents=True, exist_ok=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_closed_port()}\n")
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    code = ("import ray; from app.ray_local import init_local; init_local(num_cpus=1, include_dashboard=False); "
            "print('nodes alive:', sum(n['Alive'] for n in ray.nodes())); ray.shutdown()")
    # NOTE: not `ray stop` after: it would stop every Ray cluster on the machine. The timeout is against a
    # hang: "is gone" says the dead cluster was told apart before Ray tried to join it
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nodes alive: 1" in proc.stdout and "is gone" in proc.stderr, proc.stderr[-2000:]


def test_batch_commands_after_a_crashed_cluster_say_so_in_seconds(tmp_path):
    """``foreserve batch status`` with only a dead cluster's file: one line naming it, within
    seconds, not Ray's GCS timeout and a traceback."""
    ray_tmp = Path(f"/tmp/fsb-{os.getpid()}")
    (ray_tmp / "ray").mkdir(parents=True, exist_ok=True)
    dead = f"127.0.0.1:{_closed_port()}"
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead + "\n")
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_AUTH_MODE": "disabled"}
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "foreserve.cli.main", "batch", "status", "nosuchjob"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # against a hang
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # the probe's own words: it named the dead cluster instead of Ray's GCS timeout
    assert dead in proc.stderr and "gone" in proc.stderr, proc.stderr[-1000:]


def test_joining_a_cluster_whose_gcs_is_down_fails_in_seconds_and_says_why():
    """``RAY_ADDRESS`` naming a head whose GCS is down (or restarting): ``foreserve serve`` says so in
    seconds, where ``ray.init`` retries for a minute and more (``tests/multinode/test_gcs_restart.py``
    has it against a real head)."""
    import ray

    from app.ray_local import join_cluster

    address = f"127.0.0.1:{_closed_port()}"
    # the probe's message, not ray.init's: it never reached Ray's own retries
    with pytest.raises(RuntimeError, match=f"the Ray cluster at {address} does not answer: nothing listens at its GCS"):
        join_cluster(address, tries=2)
    assert not ray.is_initialized()
