"""Latency scheduler for the online pool: predicted shortest-remaining-first with aging,
a TPOT-capped step and TTFT-aware anti-starvation.

- Order: ``predicted remaining tokens - aging rate * seconds waited`` (priority first), so short
  answers go first and every request's key falls steadily until it reaches the head. The aging
  rate is by default one token per engine step (the measured mean step time): a waiting request is
  credited the tokens it would have produced running, so it waits at most about its own run time
  behind shorter work, on any hardware (a fixed tokens/s is far too fast on a CPU, too slow on a GPU).
- TPOT: the step time is learned online as ``a + b * tokens`` (exponentially weighted least
  squares over measured steps); the per-step token budget is capped so a step stays within the
  TPOT objective, which bounds decode batch size and prefill chunks alike.
- TTFT: a waiting request that has used half its TTFT objective may no longer be overtaken by
  smaller requests that happen to fit.
"""

from __future__ import annotations

from app.engine.request import Request
from app.engine.scheduler.base import Scheduler

MIN_STEP_TOKENS = 16  # never starve prefill entirely, whatever the step-time model says
# NOTE: aiming below the objective (85% of it was tried) held TPOT but cut throughput under
# overload on the 2-core machine (21 vs 25 tok/s), and the longer queue cost more than it saved.
TPOT_HEADROOM = 1.0
STEP_EWMA = 0.1  # weight of the newest step in the mean step time that sets the aging rate


class StepTimeModel:
    """Exponentially weighted least squares fit of ``step_s = a + b * tokens``."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, step_s: float) -> None:
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + step_s
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * step_s

    def coefficients(self) -> tuple[float, float] | None:
        if self.n < 4:
            return None
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-9:
            return None
        b = (self.n * self.sxy - self.sx * self.sy) / var
        a = (self.sy - b * self.sx) / self.n
        return (max(a, 0.0), b) if b > 0 else None

    def max_tokens_within(self, step_s: float) -> int | None:
        coef = self.coefficients()
        if coef is None:
            return None
        a, b = coef
        return int((step_s - a) / b + 1e-6)  # NOTE: 19.9999 is 20 tokens


class OnlineScheduler(Scheduler):
    name = "online"
    skip_unfit = True
    time_sensitive = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_model = StepTimeModel()
        self.mean_step_s: float | None = None

    def aging_tokens_per_s(self) -> float:
        if self.config.aging_tokens_per_s is not None:
            return self.config.aging_tokens_per_s
        return 1.0 / self.mean_step_s if self.mean_step_s else 0.0

    def _score(self, req: Request, now: float, aging: float) -> float:
        return req.predicted_remaining_tokens - aging * (now - req.arrival_s)

    def waiting_order(self) -> list[Request]:
        now, aging = self.clock(), self.aging_tokens_per_s()
        return sorted(self.waiting, key=lambda r: (-r.priority, self._score(r, now, aging), r.arrival_s))

    def running_key(self, req: Request) -> tuple:
        # Victims are taken from the end: lowest priority, then most predicted work left.
        return (-req.priority, req.predicted_remaining_tokens, self._admit_order[req.request_id])

    def _tpot_cap(self) -> int | None:
        """Tokens per step that keep a step within the TPOT objective (None until measured)."""
        return self.step_model.max_tokens_within(TPOT_HEADROOM * self.config.tpot_slo_ms / 1000.0)

    def step_token_budget(self) -> int:
        cap = self._tpot_cap()
        if cap is None:
            return self.config.max_num_batched_tokens
        return max(MIN_STEP_TOKENS, min(cap, self.config.max_num_batched_tokens))

    def max_running(self) -> int:
        # NOTE: each running sequence decodes one token a step, so the TPOT cap on tokens per
        # step is also the cap on the decode batch: admitting past it would break the SLO. Not
        # the floored step budget: an objective below the step's fixed cost must shrink the batch
        # to one, not let it grow to MIN_STEP_TOKENS.
        cap = self._tpot_cap()
        return self.config.max_num_seqs if cap is None else max(1, min(self.config.max_num_seqs, cap))

    def must_wait_for(self, req: Request) -> bool:
        return self.clock() - req.arrival_s > 0.5 * self.config.ttft_slo_ms / 1000.0

    def observe_step(self, num_tokens: int, step_s: float) -> None:
        self.step_model.observe(num_tokens, step_s)
        self.mean_step_s = step_s if self.mean_step_s is None else (1 - STEP_EWMA) * self.mean_step_s + STEP_EWMA * step_s
