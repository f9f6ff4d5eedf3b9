"""Where the length predictor's registry lives, as the process using it says: nothing of the predictor
reads the environment or knows the application's data dir.

``Store(home, tracking_uri)``: the MLflow tracking and registry store (``tracking_uri``, else sqlite
under ``<home>/mlflow``), the artifacts of a local store (``<home>/mlflow/artifacts``) and the
cache of downloaded versions (``<home>/mlflow/cache/<version>``). Entry points (the CLI, the
deployments, a batch job) build it with ``app.paths.predictor_store()`` and hand it down.

Also the download cache's checks, shared by ``loading`` (which must not import MLflow) and
``registry`` (which fills the cache).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DOWNLOAD_MARKER = ".foreserve-download.json"  # written into a complete cache entry
_REMOTE_SCHEMES = ("http", "https", "databricks", "databricks-uc")  # stores that keep their own artifacts


@dataclass(frozen=True)
class Store:
    """An MLflow store for the predictor and the data dir that holds its local files."""

    home: Path  # the data dir: <home>/mlflow holds the sqlite store, its artifacts and the download cache
    tracking_uri: str | None = None  # another MLflow store (a tracking server); None: the sqlite one under home

    @property
    def mlflow_dir(self) -> Path:
        return Path(self.home) / "mlflow"

    def uri(self) -> str:
        """``tracking_uri``, else the sqlite store under ``<home>/mlflow`` (its folder is created)."""
        if self.tracking_uri:
            return self.tracking_uri
        root = self.mlflow_dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{root}/mlflow.db"

    def artifact_root(self) -> Path | None:
        """Where a new experiment keeps its artifacts: the data dir for a local store; None (the
        server decides) for a tracking server."""
        if self.uri().split(":", 1)[0] in _REMOTE_SCHEMES:
            return None
        return self.mlflow_dir / "artifacts"

    def check_answers(self, timeout_s: float = 5.0) -> None:
        """Raise ``ConnectionError`` within ``timeout_s`` when the store is a tracking server (http or
        https) that does not answer its ``/health``: MLflow's own client retries a lost server with
        backoff for minutes before it gives up. Other stores: nothing to ask."""
        uri = self.uri()
        if uri.split(":", 1)[0] not in ("http", "https"):
            return
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
                pass
        except OSError as exc:  # URLError, a refused or timed-out connection, an HTTP error status
            raise ConnectionError(f"the registry at {uri} does not answer ({exc})") from None

    def cache_dir(self, version: str | None = None) -> Path:
        """Where registry version ``version``'s download is kept (None: the folder of all of them)."""
        root = self.mlflow_dir / "cache"
        return root / version if version is not None else root


def bad_files(predictor_dir: Path, manifest: dict[str, int]) -> list[str]:
    """The manifest entries that are missing or have another size under ``predictor_dir``."""
    return sorted(rel for rel, size_bytes in manifest.items()
                  if not (path := predictor_dir / rel).is_file() or path.stat().st_size != size_bytes)


def cached_copy(cache: Path, source: str | None = None) -> Path | None:
    """The predictor dir of a complete, undamaged download in ``cache`` (one registry version's
    entry), if it came from ``source`` (any, when None); else None."""
    try:
        marker = json.loads((cache / DOWNLOAD_MARKER).read_text())
    except (OSError, ValueError):
        return None
    manifest, predictor_dir = marker.get("manifest"), cache / str(marker.get("predictor"))
    if (source is not None and marker.get("source") != source) or not manifest or bad_files(predictor_dir, manifest):
        return None
    return predictor_dir
