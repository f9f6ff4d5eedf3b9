"""Latency scheduler for the online pool: predicted shortest-remaining-first with aging,
a TPOT-capped step and TTFT-aware anti-starvation.

- Order: ``predicted remaining tokens - aging rate * seconds waited`` (priority first), so short
  answers go first and every request's key falls steadily until it reaches the head. The prediction
  is the predictor's ranking estimate (``Prediction.rank_tokens``: its ranking score, in tokens) when it
  has one, else the reservation bound (ten bucket edges: requests in one bucket tie). The aging
  rate is counted in engine steps (``aging_tokens_per_step`` over the measured mean step time), so
  it means the same on any hardware (a fixed tokens/s is far too fast on a CPU, too slow on a GPU).
  At one token per step a waiting request is credited the tokens it would have produced running
  and waits at most about its own run time behind shorter work; but under a long queue that credit
  soon outweighs every prediction and the order decays to FCFS. The default, a quarter token per
  step, bounds the wait at about four run times and keeps the order shortest-first.
- TPOT: the step time is learned online as a non-decreasing function of the tokens a step carries
  (running means per bin of step sizes, made monotone; ``StepTimeModel``). The per-step token budget,
  which bounds the decode batch and the prefill chunk alike (Sarathi-Serve's stall-free batching: a
  step's decodes first, prompt chunks in what is left), is the throughput knee: the fewest tokens
  that still run at ``knee_throughput_fraction`` of the best tokens/s measured within the TPOT
  objective. Where step time stays flat as the batch grows (a GPU) TPOT stays far below the
  objective at nearly the full throughput; where throughput keeps rising with the batch (a 2-core
  CPU) the knee nears the objective: with a step time ``a + b * tokens`` the knee's is ``a / (1 - f + f
  * a / objective)``, about 7 one-token steps where ``a`` is 12 ms, at f = 0.9 and 250 ms, whatever
  ``b``. So ``tpot_slowdown`` (default 3.5) also caps a step at that many one-token steps, the TPOT a
  lone answer gets: steps of ``k * a`` run at ``1 - 1/k`` of the most tokens/s ``b`` allows on any
  machine. ``tpot_target_ms`` sets the step time instead.
- TTFT: a waiting request that has used half its TTFT objective may no longer be overtaken by
  smaller requests that happen to fit.
"""

from __future__ import annotations

import bisect

from app.engine.request import Request
from app.engine.scheduler.base import Scheduler

MIN_STEP_TOKENS = 16  # never starve prefill entirely, whatever the step-time model says
# NOTE: aiming below the objective (85% of it was tried) held TPOT but cut throughput under
# overload on the 2-core machine (21 vs 25 tok/s), and the longer queue cost more than it saved.
TPOT_HEADROOM = 1.0


# Step sizes (tokens) are binned at these lower edges; each bin keeps its own running means.
STEP_BINS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
BIN_EWMA = 0.1  # weight of the newest step in its bin's means
BIN_WEIGHT_CAP = 20  # a bin's weight in the monotone fit: its observations, up to this


class StepTimeModel:
    """Measured step time as a non-decreasing function of the tokens a step carries.

    Each bin of step sizes keeps an exponentially weighted mean of its tokens and step times; the
    curve through the bins is made non-decreasing by pooling adjacent violators (isotonic
    regression, weighted by how often each bin was seen) and read by linear interpolation. Past the
    largest size measured it is extrapolated through the origin (step time proportional to tokens:
    exact once compute-bound, conservative before), so the cap can grow into sizes not yet run.

    NOTE: a straight-line fit ``a + b * tokens`` (the first version) broke under its own cap: once
    the cap held steps to a narrow range of sizes, noise in their times made the slope meaningless,
    and a fitted intercept above the objective pinned the decode batch at one while twenty requests
    waited (a 0.6 req/s load test on 2 cores). Bins do not forget the sizes that the cap stops running.
    """

    def __init__(self) -> None:
        self.tokens = [0.0] * len(STEP_BINS)
        self.times = [0.0] * len(STEP_BINS)
        self.counts = [0] * len(STEP_BINS)
        self._curve: list[tuple[float, float]] | None = None  # the fit, until the next observation

    def observe(self, tokens: int, step_s: float) -> None:
        if tokens <= 0:
            return
        i = bisect.bisect_right(STEP_BINS, tokens) - 1
        if self.counts[i] == 0:
            self.tokens[i], self.times[i] = float(tokens), step_s
        else:
            self.tokens[i] += BIN_EWMA * (tokens - self.tokens[i])
            self.times[i] += BIN_EWMA * (step_s - self.times[i])
        self.counts[i] += 1
        self._curve = None

    def curve(self) -> list[tuple[float, float]]:
        """(tokens, seconds) points of the non-decreasing fit, by increasing tokens (a copy)."""
        if self._curve is None:
            self._curve = self._fit()
        return list(self._curve)

    def _fit(self) -> list[tuple[float, float]]:
        # NOTE: a step's scheduling reads the curve several times (the objective's cap, the knee, the
        # one-token step, the prompt step's time); it changes only when a step is observed
        blocks: list[list[float]] = []  # [weight, weighted time, first token count, last token count]
        for x, t, n in zip(self.tokens, self.times, self.counts):
            if not n:
                continue
            w = float(min(n, BIN_WEIGHT_CAP))
            blocks.append([w, w * t, x, x])
            while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] > blocks[-1][1] / blocks[-1][0]:
                w2, wt2, _, x_hi = blocks.pop()
                blocks[-1][0] += w2
                blocks[-1][1] += wt2
                blocks[-1][3] = x_hi
        points: list[tuple[float, float]] = []
        for w, wt, x_lo, x_hi in blocks:  # a pooled block is flat over the sizes it covers
            points.append((x_lo, wt / w))
            if x_hi > x_lo:
                points.append((x_hi, wt / w))
        return points

    def max_tokens_within(self, step_s: float) -> int | None:
        """The most tokens a step may carry and still take at most ``step_s`` (None until measured)."""
        if sum(self.counts) < 4:
            return None
        points = self.curve()
        x0, t0 = points[0]
        if t0 > step_s:
            return int(x0 * step_s / t0)  # even the smallest step misses: shrink below it (0 means none)
        for (xa, ta), (xb, tb) in zip(points, points[1:]):
            if tb > step_s:
                return int(xa + (xb - xa) * (step_s - ta) / (tb - ta) + 1e-6)
        x_last, t_last = points[-1]
        return int(x_last * step_s / t_last + 1e-6)

    def time_at(self, tokens: float) -> float | None:
        """The step time the curve gives for ``tokens`` (None until measured): interpolated between
        sizes measured, proportional to tokens below the smallest and past the largest."""
        if sum(self.counts) < 4:
            return None
        points = self.curve()
        if tokens <= points[0][0]:
            return points[0][1] * tokens / points[0][0]
        for (xa, ta), (xb, tb) in zip(points, points[1:]):
            if tokens <= xb:
                return ta + (tb - ta) * (tokens - xa) / (xb - xa)
        return points[-1][1] * tokens / points[-1][0]

    def base_step_s(self) -> float | None:
        """The step time at the smallest size measured (None until measured): a one-token step's once
        one has run, the fixed cost every step pays, at most over by the few tokens above one."""
        if sum(self.counts) < 4:
            return None
        return self.curve()[0][1]

    def knee_tokens(self, limit: int, fraction: float) -> int | None:
        """The fewest tokens a step may carry and still run at ``fraction`` of the best throughput
        (tokens per second of step) measured at up to ``limit`` tokens; None until measured.

        The curve is read up to ``limit`` itself where a larger size was measured. Where the knee is
        the largest size measured (throughput still rose by more than ``1 / fraction`` up to it),
        twice that size, up to ``limit``: the steps grow until the model has seen where throughput
        flattens, since past the sizes run it cannot tell."""
        if sum(self.counts) < 4:
            return None
        curve = self.curve()
        points = [(x, t) for x, t in curve if x <= limit and t > 0]
        if not points:
            return limit  # every size measured is above the limit: nothing smaller to choose by
        above = next(((x, t) for x, t in curve if x > limit), None)
        if above is not None and points[-1][0] < limit:  # NOTE: the limit itself, read off the curve between
            (xa, ta), (xb, tb) = points[-1], above
            points.append((limit, ta + (tb - ta) * (limit - xa) / (xb - xa)))
        rates = [x / t for x, t in points]
        knee = next(i for i, r in enumerate(rates) if r >= fraction * max(rates))
        tokens = max(1, int(points[knee][0]))
        return min(limit, 2 * tokens) if knee == len(points) - 1 else tokens


class OnlineScheduler(Scheduler):
    name = "online"
    skip_unfit = True
    time_sensitive = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_model = StepTimeModel()

    def aging_tokens_per_s(self) -> float:
        if self.config.aging_tokens_per_s is not None:
            return self.config.aging_tokens_per_s
        return self.config.aging_tokens_per_step / self.recent_step_s if self.recent_step_s else 0.0

    def _score(self, req: Request, now: float, aging: float) -> float:
        return req.rank_remaining_tokens - aging * (now - req.arrival_s)

    def waiting_order(self) -> list[Request]:
        now, aging = self.clock(), self.aging_tokens_per_s()
        return sorted(self.waiting, key=lambda r: (-r.priority, self._score(r, now, aging), r.arrival_s))

    def running_key(self, req: Request) -> tuple:
        # Victims are taken from the end: lowest priority, then most predicted work left.
        return (-req.priority, req.rank_remaining_tokens, self._admit_order[req.request_id])

    def _tpot_cap(self) -> int | None:
        """Tokens per step (None until measured): within the TPOT target if one is set, else the
        throughput knee below the TPOT objective, and no more than ``tpot_slowdown`` one-token steps
        take if that is set."""
        slo_s = TPOT_HEADROOM * self.config.tpot_slo_ms / 1000.0
        if self.config.tpot_target_ms is not None:
            return self.step_model.max_tokens_within(min(slo_s, self.config.tpot_target_ms / 1000.0))
        cap = self.step_model.max_tokens_within(slo_s)
        if cap is None:
            return None
        if self.config.knee_throughput_fraction < 1.0:
            cap = self.step_model.knee_tokens(cap, self.config.knee_throughput_fraction)
        if self.config.tpot_slowdown is not None:
            # NOTE: where tokens/s keeps rising with the batch (a CPU) the knee nears the objective and
            # this is the smaller; where it flattens early (a GPU) the knee is, and steps past it would
            # add TPOT for next to no tokens/s
            slow_s = self.config.tpot_slowdown * self.step_model.base_step_s()  # measured, as the cap above
            cap = min(cap, self.step_model.max_tokens_within(min(slo_s, slow_s)))
        return cap

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

    def prompt_step_s(self) -> float | None:
        # NOTE: a step that carries a prompt chunk is full (decodes, then prompt tokens up to the
        # budget), and on a CPU takes several times the decode-only steps that set the recent mean
        step_s = self.step_model.time_at(self.step_token_budget())
        recent = self.recent_step_s
        return recent if step_s is None else max(step_s, recent or 0.0)

    def must_wait_for(self, req: Request) -> bool:
        return self.clock() - req.arrival_s > 0.5 * self.config.ttft_slo_ms / 1000.0

    def observe_step(self, num_tokens: int, step_s: float) -> None:
        super().observe_step(num_tokens, step_s)
        self.step_model.observe(num_tokens, step_s)
