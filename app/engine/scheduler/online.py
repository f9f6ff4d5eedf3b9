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
- Slack: while a prompt waits or is in prefill, a step may take longer than the cap by half the
  least TPOT slack of the answers decoding in it (``tpot_slack``): the time each can lose and still
  end within the objective on average, which is what the objective measures.
- TTFT: a waiting request that has used half its TTFT objective may no longer be overtaken by
  smaller requests that happen to fit.
"""

from __future__ import annotations

from collections.abc import Callable

from app.engine.request import Request
from app.engine.scheduler.base import Scheduler
from app.engine.scheduler.step_time import STEP_BINS, StepTimeModel  # noqa: F401 - re-exported (the simulator's bins)
from app.engine.scheduler.tpot_slack import SLACK_SHARE, answer_slack_s

MIN_STEP_TOKENS = 16  # never starve prefill entirely, whatever the step-time model says
# NOTE: aiming below the objective (85% of it was tried) held TPOT but cut throughput under
# overload on the 2-core machine (21 vs 25 tok/s), and the longer queue cost more than it saved.
TPOT_HEADROOM = 1.0


class OnlineScheduler(Scheduler):
    name = "online"
    skip_unfit = True
    time_sensitive = True

    def aging_tokens_per_s(self) -> float:
        if self.config.aging_tokens_per_s is not None:
            return self.config.aging_tokens_per_s
        return self.config.aging_tokens_per_step / self.recent_step_s if self.recent_step_s else 0.0

    def _score(self, req: Request, now: float, aging: float) -> float:
        return req.rank_remaining_tokens - aging * (now - req.arrival_s)

    def waiting_key(self) -> Callable[[Request], tuple]:
        now, aging = self.clock(), self.aging_tokens_per_s()
        return lambda r: (-r.priority, self._score(r, now, aging), r.arrival_s)

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
        # NOTE: the cap keeps the decoding answers' TPOT; with none decoding there is no TPOT to keep,
        # and a prompt takes the whole step: in chunks of the cap's few dozen tokens a lone long prompt
        # paid the fixed cost of many small steps before its first token
        decodes = sum(r.decoding for r in self.running)
        if not decodes:
            return self.config.max_num_batched_tokens
        if not self.waiting and decodes == len(self.running):
            return self.decode_step_budget()  # no prompt to spend slack on
        return self.budget_within_slack(decodes, self.tpot_slack_s())

    def tpot_slack_s(self) -> float | None:
        """The least TPOT slack of the answers decoding (None: none decodes, or no pace yet)."""
        decoding = [r for r in self.running if r.decoding and r.first_token_s is not None]
        step_s = self._capped_step_s(len(decoding)) if decoding else None
        if step_s is None:
            return None
        now, slo_s = self.clock(), self.config.tpot_slo_ms / 1000.0
        return min(answer_slack_s(slo_s, r.num_output_tokens, now - r.first_token_s, r.predicted_remaining_tokens, step_s)
                   for r in decoding)

    def answer_slack_s(self, tokens_out: int, decoding_s: float, remaining: int, decodes: int) -> float | None:
        step_s = self._capped_step_s(decodes)
        if step_s is None:
            return None
        return answer_slack_s(self.config.tpot_slo_ms / 1000.0, tokens_out, decoding_s, remaining, step_s)

    def budget_within_slack(self, decodes: int, slack_s: float | None) -> int:
        cap = self.decode_step_budget()
        step_s = self._capped_step_s(decodes, cap)
        if slack_s is None or slack_s <= 0 or step_s is None:
            return cap
        within = self.step_model.max_tokens_within(step_s + SLACK_SHARE * slack_s)
        return cap if within is None else max(cap, min(within, self.config.max_num_batched_tokens))

    def slack_after_step(self, slack_s: float | None, decodes: int, step_s: float) -> float | None:
        capped = self._capped_step_s(decodes)
        return None if slack_s is None or capped is None else slack_s + capped - step_s

    def _capped_step_s(self, decodes: int, cap: int | None = None) -> float | None:
        """The longest a step within the TPOT cap (``cap``: ``decode_step_budget()``) takes, at most the
        objective: what the slack counts every step after the next one at."""
        step_s = self.step_time_s(max(decodes, self.decode_step_budget() if cap is None else cap))
        return None if step_s is None else min(step_s, self.config.tpot_slo_ms / 1000.0)

    def decode_step_budget(self) -> int:
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
