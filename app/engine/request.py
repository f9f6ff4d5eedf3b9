"""Requests, sampling parameters and the typed hand-offs between scheduler, runner and engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator


GREEDY_TEMPERATURE = 1e-5  # below it sampling is argmax


class SamplingParams(BaseModel):
    """How to sample one request. Validated at construction; the runner trusts these values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(1024, ge=1, description="Upper bound on generated tokens.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Per-request RNG seed (int64, as OpenAI's).")
    stop: tuple[str, ...] = Field((), description="Stop strings; the output is cut before them.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")

    @model_validator(mode="after")
    def _check_stop(self) -> "SamplingParams":
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def greedy(self) -> bool:
        # NOTE: a temperature this small divides the logits into inf/NaN (0 in float32): it is argmax
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stopped"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One generation request and its progress. Owned by the scheduler; mutated only by it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    tier: str = "online"
    priority: int = 0
    # A guess, named as one: the reservation bound (upper edge of the predicted bucket).
    predicted_output_tokens: int = 0
    predicted_bucket: int = -1
    bucket_probs: list[float] | None = None
    # The predictor's length estimate to order by (its ranking score in tokens; the bound is a
    # reservation at a quantile, and ties within a bucket). None: the online scheduler orders by the bound.
    rank_output_tokens: float | None = None
    # Known only in benchmarks replaying a trace; the `oracle` policy reserves exactly this.
    true_output_tokens: int | None = None
    # Benchmarks replaying a trace stop each request at its true length (EOS ignored).
    force_true_length: bool = False
    prompt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_overtaken: int = 0  # admission passes that admitted others past it while it did not fit
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    @property
    def predicted_remaining_tokens(self) -> int:
        return max(self.predicted_output_tokens - self.num_output_tokens, 1)

    @property
    def rank_remaining_tokens(self) -> float:
        """Predicted tokens still to generate, by the ranking estimate while it holds; an answer
        that outgrew it falls back to the bound (not to "one token left" forever)."""
        if self.rank_output_tokens is None or self.num_output_tokens >= self.rank_output_tokens:
            return self.predicted_remaining_tokens
        return self.rank_output_tokens - self.num_output_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) of prompt + output."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]


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
    sampled_token_ids: dict[str, int]  # request_id -> next token, for chunks with sample=True
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


class Runner:
    """What the engine needs of a model runner (real, tensor-parallel or simulated).

    ``execute`` runs one step: writes the KV of every scheduled token into the pool blocks named by
    each chunk's block table, and samples one token for every chunk with ``sample=True``.
    """

    simulated: bool = False
    eos_token_id: int | None = None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:  # pragma: no cover
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release processes/devices. Idempotent."""
