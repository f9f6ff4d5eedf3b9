"""Every autoscaling decision, with its reason: Serve's controller log, a JSONL file and metrics.

The policies run inside Serve's controller, every ``metrics_interval``-ish tick. A decision is logged
when a pool's desired replica count or its reason changes (not on every tick); the desired count is
exported on every tick as the gauge ``foreserve_autoscale_desired_replicas{pool}`` and each change
counts in ``foreserve_autoscale_decisions{pool,direction,reason}`` (Prometheus through Ray).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True, slots=True)
class Decision:
    """A pool's desired replica count and why (``reason`` is a short stable word, ``detail`` prose)."""

    pool: str
    current: int
    desired: int
    reason: str
    detail: str = ""
    signals: dict = field(default_factory=dict)

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


def default_log_path() -> Path:
    from app.paths import home

    return home() / "autoscale" / "decisions.jsonl"


class DecisionLog:
    """Logs decisions on change; ``path=None`` logs to the Serve logger only, ``quiet`` not even
    there (a simulated day makes thousands)."""

    def __init__(self, path: str | Path | None = None, quiet: bool = False) -> None:
        self.path = Path(path) if path else None
        self.quiet = quiet
        self._last: dict[str, tuple[int, str]] = {}
        self._metrics = None

    def record(self, decision: Decision, now: float | None = None) -> bool:
        """Export ``decision``; returns True when it was new (and so logged)."""
        self._export(decision)
        key = (decision.desired, decision.reason)
        if self._last.get(decision.pool) == key:
            return False
        self._last[decision.pool] = key
        entry = {"time": now if now is not None else time.time(), "direction": decision.direction, **asdict(decision)}
        if not self.quiet:
            logger.info("foreserve autoscale: %s %d -> %d (%s) %s %s", decision.pool, decision.current,
                        decision.desired, decision.reason, decision.detail, decision.signals)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write(json.dumps(entry) + "\n")
            except OSError as exc:  # a full disk must not stop autoscaling
                logger.warning("cannot append to the decision log %s: %s", self.path, exc)
        if self._metrics is not None:
            self._metrics[1].inc(1, {"pool": decision.pool, "direction": decision.direction, "reason": decision.reason})
        return True

    def _export(self, decision: Decision) -> None:
        if self.quiet:
            return
        if self._metrics is None:
            import ray

            if not ray.is_initialized():  # unit tests call the policies without Ray
                return
            from ray.util.metrics import Counter, Gauge

            self._metrics = (
                Gauge("foreserve_autoscale_desired_replicas", "Replicas the foreserve policy wants per pool.", ("pool",)),
                Counter("foreserve_autoscale_decisions", "Changes of a pool's desired replicas or reason.",
                        ("pool", "direction", "reason")),
            )
        self._metrics[0].set(decision.desired, {"pool": decision.pool})


def read_decisions(path: str | Path | None = None) -> list[dict]:
    """The decision log's entries, oldest first (empty when there is none yet)."""
    path = Path(path) if path else default_log_path()
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
