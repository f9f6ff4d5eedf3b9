"""The local Ray cluster a foreserve command on this machine joins or starts.

``ray.init()`` without an address joins the cluster named in Ray's current-cluster file (under its
temp dir). After that cluster died uncleanly (its processes killed, an OOM kill, a reboot of the
container) the file still names it, and Ray retries the dead GCS for minutes without a word,
ignoring Ctrl-C. ``dead_local_cluster`` asks the GCS port first (a TCP connect, 2 s at most), so
the commands start a fresh local cluster instead and say why. ``join_cluster`` does the same for the
cluster at ``RAY_ADDRESS``: a head whose GCS is down is said in seconds, not retried for minutes.
"""

from __future__ import annotations

import os
import socket
import time


def gcs_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something listens at the GCS address ``host:port`` (a TCP connect)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def dead_local_cluster(temp_dir: str | None = None, timeout_s: float = 2.0) -> str | None:
    """The address Ray's current-cluster file names if nothing listens there, else None (no file,
    a live cluster, or RAY_ADDRESS set: then the user chose the cluster)."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    from ray._private.utils import read_ray_address

    address = read_ray_address(temp_dir)
    if not address or gcs_answers(address, timeout_s):
        return None
    return address


def init_local(**kwargs) -> None:
    """``ray.init(**kwargs)``, joining the local cluster Ray names if it is alive, else starting a
    fresh one (with a line on stderr naming the dead one)."""
    import sys

    import ray

    dead = dead_local_cluster()
    if dead is not None and "address" not in kwargs:
        print(f"the local Ray cluster at {dead} is gone (its processes died without `ray stop`); starting a fresh one",
              file=sys.stderr, flush=True)
        kwargs["address"] = "local"
    ray.init(**kwargs)


def join_cluster(address: str, tries: int = 3, **kwargs) -> None:
    """``ray.init(address, **kwargs)`` for the cluster at ``RAY_ADDRESS``; when its GCS does not answer
    (the head is down, or restarting its GCS), a ``RuntimeError`` within seconds that says so, where
    Ray would retry for a minute and more. ``ray://`` (Ray Client) and ``auto`` are passed through."""
    import ray

    if "://" not in address and address != "auto":
        for attempt in range(tries):
            if gcs_answers(address):
                break
            if attempt == tries - 1:
                raise RuntimeError(
                    f"the Ray cluster at {address} does not answer: nothing listens at its GCS (the head is down, "
                    "or its GCS is restarting). Replicas already deployed keep serving meanwhile, on a cluster "
                    "with GCS fault tolerance (docs/cluster.md); deploy again once "
                    f"`ray status --address {address}` answers")
            time.sleep(1.0)
    ray.init(address=address, **kwargs)
