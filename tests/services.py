"""Real servers a test starts for itself and stops after: PostgreSQL (Debian's ``postgresql``, installed
when missing) in a private data folder on a free port, for MLflow's tracking server; an S3-compatible
object store (moto's server) for foreserve's store; Redis (Debian's ``redis-server``, installed when
missing) for Ray's GCS fault tolerance."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.ports import free_port

PG_VERSION = "15"


def _apt_install(package: str) -> None:
    subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, capture_output=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def _pg_bin() -> Path:
    root = Path(f"/usr/lib/postgresql/{PG_VERSION}/bin")
    if not (root / "initdb").exists():
        _apt_install(f"postgresql-{PG_VERSION}")
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


# What a node needs in its environment to open the test bucket (pyarrow reads AWS credentials from
# the environment, never from the URI): dummy keys moto accepts.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def s3_server(bucket: str = "foreserve") -> Iterator[str]:
    """An S3-compatible server (moto's server mode, the stand-in Ray's own tests use) on a free
    port of 127.0.0.1, ``bucket`` created; yields the store URI of that bucket with its endpoint.
    ``S3_ENV`` is set in this process while it runs; other processes and nodes need it too."""
    port = free_port()
    env = pytest.MonkeyPatch()
    for key, value in S3_ENV.items():
        env.setenv(key, value)
    log = tempfile.NamedTemporaryFile(prefix="foreserve-s3-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start: {Path(log.name).read_text()[-2000:]}") from None
                time.sleep(0.2)
        uri = (f"s3://{bucket}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
               "&allow_bucket_creation=true")
        import pyarrow.fs as pafs

        pafs.FileSystem.from_uri(uri)[0].create_dir(bucket)
        yield uri
    finally:
        env.undo()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        os.unlink(log.name)


@contextlib.contextmanager
def redis() -> Iterator[str]:
    """A Redis server on a free port of 127.0.0.1, its folder fresh under /tmp, persistence off (Ray's
    GCS keeps what it needs to restart there while the server runs); yields ``host:port``, as Ray's
    ``RAY_REDIS_ADDRESS`` takes it. Shut down and removed after."""
    if shutil.which("redis-server") is None:
        _apt_install("redis-server")
    folder = Path(tempfile.mkdtemp(prefix="foreserve-redis-"))
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder),
                             "--save", "", "--appendonly", "no", "--logfile", str(folder / "redis.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(folder / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
