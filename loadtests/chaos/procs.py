"""The service's processes on this machine, by role, from ``/proc``: Ray names its actors' processes
``ray::ServeReplica:<app>:<deployment>``, ``ray::ProxyActor`` and ``ray::ServeController``. Used to inject faults (signals)
and to read memory (RSS) before and after each scenario."""

from __future__ import annotations

import os
import signal
from pathlib import Path

ROLES = ("ingress", "online", "offline", "predictor", "proxy", "controller")
RAY_ACTORS = {"proxy": "ray::ProxyActor", "controller": "ray::ServeController"}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _scan(keep) -> list[int]:
    """Live processes (other than this one) whose command line ``keep`` accepts, sorted."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            line = _cmdline(int(entry))
            if line and keep(line):
                found.append(int(entry))
    return sorted(found)


def pids(role: str, app: str = "foreserve") -> list[int]:
    """Live processes of ``role`` (a deployment of ``app``, or Serve's ``proxy`` or ``controller``)."""
    want = RAY_ACTORS.get(role, f"ray::ServeReplica:{app}:{role}")
    return _scan(lambda line: line.startswith(want))


def matching(*parts: str) -> list[int]:
    """Live processes whose command line holds each of ``parts`` (other than this one)."""
    return _scan(lambda line: all(part in line for part in parts))


def session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a command started in a session of its own, and its children)."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    alive.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return alive


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def role_memory(role: str, app: str = "foreserve") -> tuple[float, tuple[int, ...]]:
    """Summed RSS in MB of ``role``'s processes, and their pids (sorted)."""
    found = tuple(sorted(pids(role, app)))
    return round(sum(rss_mb(p) or 0.0 for p in found), 1), found


def memory(app: str = "foreserve") -> dict[str, float]:
    """Summed RSS in MB of each role's processes."""
    return {role: role_memory(role, app)[0] for role in ROLES}


def signal_role(role: str, sig: signal.Signals, app: str = "foreserve") -> list[int]:
    """Send ``sig`` to every process of ``role``; returns their pids (raises if there is none)."""
    targets = pids(role, app)
    if not targets:
        raise RuntimeError(f"no {role} process of {app!r} on this machine (is the service local?)")
    kill(targets, sig)
    return targets


def alive(targets: list[int]) -> list[int]:
    """Those of ``targets`` still running (a zombie, ended but not yet reaped, counts as gone)."""
    left = []
    for pid in targets:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            left.append(pid)
    return left


def kill(targets: list[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each of ``targets`` that is still there."""
    for pid in targets:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
