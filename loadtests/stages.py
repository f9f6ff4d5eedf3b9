"""Load stages (ramp, steady, burst) and the tier mix of a load test; plain Python, no Locust.

A stage spec is ``name:seconds:level`` or ``name:seconds:start-end`` (a linear ramp), comma separated:
``ramp:30:0.2-1,steady:60:1,burst:10:3``. The level is requests/s in open-loop mode and concurrent
users in closed-loop mode. The locustfile's LoadTestShape and the Poisson dispatcher both read it.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

TIERS = ("online", "flex")


class Stage(BaseModel):
    name: str
    duration_s: float = Field(gt=0)
    start: float = Field(ge=0, description="requests/s (open loop) or users (closed loop) at the stage's start")
    end: float = Field(ge=0, description="the same at its end; equal to start for a steady stage")


class Stages(BaseModel):
    stages: list[Stage] = Field(min_length=1)

    @property
    def total_s(self) -> float:
        return sum(s.duration_s for s in self.stages)

    def level_at(self, t: float) -> float | None:
        """The rate (or users) ``t`` seconds into the test, None once every stage is over."""
        for stage in self.stages:
            if t < stage.duration_s:
                return stage.start + (stage.end - stage.start) * t / stage.duration_s
            t -= stage.duration_s
        return None

    def stage_at(self, t: float) -> str | None:
        for stage in self.stages:
            if t < stage.duration_s:
                return stage.name
            t -= stage.duration_s
        return None

    def mean_level(self) -> float:
        return sum((s.start + s.end) / 2 * s.duration_s for s in self.stages) / self.total_s

    def spec(self) -> str:
        return ",".join(f"{s.name}:{s.duration_s:g}:{s.start:g}" + (f"-{s.end:g}" if s.end != s.start else "")
                        for s in self.stages)


def parse_stages(text: str) -> Stages:
    """``ramp:30:0.2-1,steady:60:1`` → Stages; a clear ValueError on anything else."""
    stages = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        fields = part.split(":")
        if len(fields) != 3:
            raise ValueError(f"stage {part!r}: expected name:seconds:level or name:seconds:start-end")
        name, seconds, level = fields
        try:
            start, _, end = level.partition("-")
            stages.append(Stage(name=name, duration_s=float(seconds), start=float(start), end=float(end or start)))
        except ValueError as exc:
            raise ValueError(f"stage {part!r}: {exc}") from None
    if not stages:
        raise ValueError("no stages given")
    return Stages(stages=stages)


def parse_tier_mix(text: str) -> dict[str, float]:
    """``online=0.7,flex=0.3`` → normalized weights over online and flex."""
    mix = {tier: 0.0 for tier in TIERS}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        tier, sep, weight = part.partition("=")
        if not sep or tier not in TIERS:
            raise ValueError(f"tier mix {part!r}: expected online=W or flex=W")
        try:
            mix[tier] = float(weight)
        except ValueError:
            raise ValueError(f"tier mix {part!r}: {weight!r} is not a number") from None
        if mix[tier] < 0:
            raise ValueError(f"tier mix {part!r}: weights must be >= 0")
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"tier mix {text!r}: give at least one positive weight")
    return {tier: w / total for tier, w in mix.items()}
