"""The typed hand-offs of a step: scheduler -> runner (``SchedulerOutput``), runner -> scheduler
(``ModelRunnerOutput``), engine -> caller (``RequestOutput``, and ``EngineStats`` for a replica's counters)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.request import SamplingParams


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one sequence to run this step. Picklable: it crosses process boundaries (TP ranks)."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]; KV for [0, start_pos) is already in the pool
    block_ids: list[int]  # the sequence's block table (opaque to the scheduler)
    sample: bool  # True when this chunk reaches the sequence end: the runner samples a token
    sampling: SamplingParams
    num_output_tokens: int  # generated so far (for seeded sampling offsets)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    finished_request_ids: list[str] = field(default_factory=list)  # runner may drop their state

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(slots=True)
class ModelRunnerOutput:
    # request_id -> next token, for chunks with sample=True; None: the row could not be sampled (NaN
    # logits), so that request fails and the others go on
    sampled_token_ids: dict[str, int | None]
    step_s: float  # measured (real runner) or modelled (simulated runner) time of the step


@dataclass(slots=True)
class RequestOutput:
    """What the engine streams back for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # the request failed (finish_reason "error"): why
    retryable: bool = False  # refused, not failed: it waited past max_queue_delay_ms unstarted (429)
    # On the output with its first token here: the seconds since it was queued, and the estimate made
    # then (app/engine/ttft.py, by a pool that sheds load; None where none was made: no pace yet, a resumed answer)
    ttft_s: float | None = None
    ttft_estimate_s: float | None = None


@dataclass
class EngineStats:
    """An engine's counters since it started (``LLMEngine.stats``)."""

    steps: int
    forward_s: float
    wall_s: float
    output_tokens: int
    preemptions: int
    overflow_preemptions: int
    recomputed_tokens: int
    mean_running_batch: float
    peak_kv_used_tokens: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    num_waiting: int
    num_running: int
    predictor_fallbacks: int = 0
