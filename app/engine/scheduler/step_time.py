"""The measured step time as a function of the tokens a step carries (``StepTimeModel``): what the
online scheduler sizes its steps by and the load shedder prices a request's first token with."""

from __future__ import annotations

import bisect
import math

# Step sizes (tokens) are binned at these lower edges; each bin keeps its own running means.
STEP_BINS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
BIN_EWMA = 0.1  # weight of the newest step in its bin's means
BIN_WEIGHT_CAP = 20  # a bin's weight in the monotone fit: its observations, up to this
# A bin's mean ages: a step of a size last seen this long ago replaces most of it (1 - 1/e). Steps
# slowed by an overload (other processes busy on the cores) must not keep pricing the calm that follows.
BIN_STALE_S = 10.0


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
        self.seen_s = [0.0] * len(STEP_BINS)  # when each bin last had a step (the caller's clock)
        self._curve: list[tuple[float, float]] | None = None  # the fit, until the next observation

    def observe(self, tokens: int, step_s: float, now_s: float | None = None) -> None:
        """One step of ``tokens`` that took ``step_s``, ended at ``now_s`` (None: ages nothing)."""
        if tokens <= 0:
            return
        i = bisect.bisect_right(STEP_BINS, tokens) - 1
        weight = BIN_EWMA
        if now_s is not None:
            weight = max(weight, 1.0 - math.exp(-max(0.0, now_s - self.seen_s[i]) / BIN_STALE_S))
            self.seen_s[i] = now_s
        if self.counts[i] == 0:
            self.tokens[i], self.times[i] = float(tokens), step_s
        else:
            self.tokens[i] += weight * (tokens - self.tokens[i])
            self.times[i] += weight * (step_s - self.times[i])
        self.counts[i] += 1
        self._curve = None

    def curve(self) -> list[tuple[float, float]]:
        """(tokens, seconds) points of the non-decreasing fit, by increasing tokens (a copy)."""
        return list(self._points())

    def _points(self) -> list[tuple[float, float]]:
        # NOTE: the fit itself, not a copy: the load shedder's estimate reads it once a step it plays forward
        if self._curve is None:
            self._curve = self._fit()
        return self._curve

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
        points = self._points()
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
        points = self._points()
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
        return self._points()[0][1]

    def knee_tokens(self, limit: int, fraction: float) -> int | None:
        """The fewest tokens a step may carry and still run at ``fraction`` of the best throughput
        (tokens per second of step) measured at up to ``limit`` tokens; None until measured.

        The curve is read up to ``limit`` itself where a larger size was measured. Where the knee is
        the largest size measured (throughput still rose by more than ``1 / fraction`` up to it),
        twice that size, up to ``limit``: the steps grow until the model has seen where throughput
        flattens, since past the sizes run it cannot tell."""
        if sum(self.counts) < 4:
            return None
        curve = self._points()
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
