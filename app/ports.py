"""Free TCP ports for services foreserve starts on the side (Serve's proxy, an MLflow server, the
tensor-parallel rendezvous).

A port is drawn below the kernel's ephemeral range and above Ray's worker ports. Ray's own processes
bind port 0 and every outgoing connection takes an ephemeral port, so a port asked of the kernel
with ``bind(0)`` and released can be handed to one of them before our service binds it; a port
outside that range cannot."""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_MAX = 19999  # Ray's default --max-worker-port


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (Linux's default when unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port on ``host`` that nothing is bound to now, from outside the ephemeral range."""
    low = RAY_WORKER_PORTS_MAX + 1
    high = ephemeral_range()[0] - 1
    candidates = range(low, high + 1) if high > low else range(1024, 65536)
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on {host} in {candidates.start}-{candidates.stop - 1}")
