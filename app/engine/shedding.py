"""Load shedding for a latency pool (``EngineConfig.max_queue_delay_ms``): refuse a new request
rather than queue it where its first token would come too late. Two tests, because the first lags:
the oldest request without its first token has waited past the limit; or the prompt tokens still
to prefill ahead of the new one would take past the limit at the pace the engine's recent steps
prefilled (a burst is otherwise taken whole before anyone has waited long)."""

from __future__ import annotations

from collections.abc import Iterable

from app.engine.outputs import SchedulerOutput
from app.engine.request import Request


class EngineOverloaded(RuntimeError):
    """The queue is past ``max_queue_delay_ms``; the request may be sent again later (429)."""


class LoadShedder:
    def __init__(self, limit_ms: float) -> None:
        self.limit_s = limit_ms / 1000
        self.prefill_tokens_per_s: float | None = None  # EWMA over steps that carried prompt tokens

    def observe(self, sched_out: SchedulerOutput, step_s: float) -> None:
        # NOTE: measured beside the step's decode rows, as the waiting prompts will be prefilled
        prefill = sum(len(c.token_ids) for c in sched_out.chunks if len(c.token_ids) > 1)
        if prefill and step_s > 0:
            pace = prefill / step_s
            self.prefill_tokens_per_s = pace if self.prefill_tokens_per_s is None else 0.8 * self.prefill_tokens_per_s + 0.2 * pace

    def check(self, requests: Iterable[Request], now_s: float) -> None:
        """Raise ``EngineOverloaded`` if a new request should be refused."""
        pending = [r for r in requests if not r.output_token_ids]
        waited = now_s - min(r.arrival_s for r in pending) if pending else 0.0
        limit_ms = f"max_queue_delay_ms ({self.limit_s * 1000:g})"
        if waited > self.limit_s:
            raise EngineOverloaded(f"the oldest waiting request has waited {waited:.1f} s, past this pool's {limit_ms}")
        if pace := self.prefill_tokens_per_s:
            # NOTE: the new prompt's own prefill is not queueing: a lone long prompt is always taken
            ahead = sum(r.num_prompt_tokens - r.num_computed_tokens for r in pending)
            if ahead / pace > self.limit_s:
                raise EngineOverloaded(f"{ahead} prompt tokens to prefill first would take {ahead / pace:.1f} s at "
                                       f"{pace:.0f} tokens/s, past this pool's {limit_ms}")
