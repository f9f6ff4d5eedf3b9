"""Real servers a test starts for itself and stops after: PostgreSQL (Debian's ``postgresql``, installed
when missing) in a private data folder on a free port, for MLflow's tracking server."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from app.ports import free_port

PG_VERSION = "15"


def _pg_bin() -> Path:
    root = Path(f"/usr/lib/postgresql/{PG_VERSION}/bin")
    if not (root / "initdb").exists():
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", f"postgresql-{PG_VERSION}"], check=True, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return root


def _as_postgres(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """PostgreSQL refuses to run as root: its tools run as the ``postgres`` user when we are root."""
    if os.geteuid() == 0:
        args = ["runuser", "-u", "postgres", "--", *args]
    return subprocess.run(args, check=True, capture_output=True, text=True, **kwargs)


@contextlib.contextmanager
def postgres(database: str = "mlflow") -> Iterator[str]:
    """A PostgreSQL server with its data in a fresh folder under /tmp (pytest's tmp folders are
    private to root), listening on 127.0.0.1 only, ``database`` created; yields its SQLAlchemy URI.
    Stopped (fast mode) and removed after."""
    bin_dir = _pg_bin()
    folder = Path(tempfile.mkdtemp(prefix="foreserve-pg-"))
    data, sockets = folder / "data", folder / "sockets"
    sockets.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        for path in (folder, sockets):
            os.chown(path, user.pw_uid, user.pw_gid)
    port = free_port()
    _as_postgres([str(bin_dir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "--no-sync"])
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
    _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(folder / "server.log"), "-w", "start"])
    try:
        _as_postgres([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", database])
        yield f"postgresql://postgres@127.0.0.1:{port}/{database}"
    finally:
        _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"])
        shutil.rmtree(folder, ignore_errors=True)
