"""What a caller hands the engine (sampling parameters, the prediction, the request) and the state the scheduler keeps."""

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


class Prediction(BaseModel):
    """What the length predictor said of one prompt: the engine reserves and orders by it. Every
    field is a guess and named as one; it comes from the ingress, a batch stage or the engine's own
    predictor, and travels whole."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: int = Field(-1, ge=-1, description="The predicted length bucket; -1: no prediction.")
    probabilities: tuple[float, ...] | None = Field(None, description="The bucket distribution, when the predictor has one.")
    bound_tokens: int = Field(ge=1, description="Output tokens to reserve: the pool's quantile of the distribution "
                              "(the engine clamps it to max_tokens).")
    rank_tokens: float | None = Field(None, description="The length estimate the online scheduler orders by; None orders by the bound.")
    version: str | None = Field(None, description="The predictor version that made it (`max-fallback` when it failed).")
    predictor_bound_tokens: int | None = Field(None, ge=1, description="The predictor's own bound, at its version's quantile: "
                                               "what the feedback record judges; None: bound_tokens.")
    exact_tokens: int | None = Field(None, ge=1, description="An oracle's: the recorded length of a replayed answer, "
                                     "which the `oracle` allocation policy reserves.")


@dataclass(slots=True, kw_only=True)
class EngineRequest:
    """What a caller hands ``LLMEngine.add_request``: the prompt, how to sample, and what the
    predictor said. ``prediction=None`` asks the engine's own predictor with ``predictor_text``."""

    prompt_token_ids: list[int] | None = None  # else ``prompt`` is tokenized by the engine
    prompt: str | None = None
    sampling: SamplingParams | None = None  # None: greedy-free defaults with the engine's default max_tokens
    request_id: str | None = None  # None: a fresh uuid
    tier: str = "online"
    priority: int = 0
    prediction: Prediction | None = None
    # The text the predictor reads (the user's message) and the feedback record keeps; None: the prompt.
    predictor_text: str | None = None
    # An answer another replica started and lost: its tokens count as generated and are recomputed;
    # only text after the first ``resume_emitted_chars`` characters is streamed.
    resume_output_token_ids: list[int] = field(default_factory=list)
    resume_emitted_chars: int = 0
    detokenize: bool = True  # False: token ids only (benchmarks)
    # False (vLLM's final-only output): the text comes whole in the finished output.
    stream_text: bool = True


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again: its KV was dropped and is recomputed on admission
    FINISHED_STOPPED = "stopped"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "aborted"
    FINISHED_ERROR = "error"  # the runner could not sample it (NaN logits): it alone fails

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)

    @property
    def queued(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


# The OpenAI word for each way a request ends.
FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


@dataclass(eq=False)
class Request:
    """One generation request and its progress. Owned by the scheduler; mutated only by it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    prediction: Prediction
    tier: str = "online"
    priority: int = 0
    # The reservation bound (starts at the prediction's, clamped to max_tokens; grows when outgrown).
    predicted_output_tokens: int = 0
    prompt: str | None = None
    predictor_text: str | None = None  # what the predictor read; the feedback record keeps it

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_overtaken: int = 0  # admission passes that admitted others past it while it did not fit
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None  # the OpenAI word: stop, length, abort
    # At admission to a pool that sheds load (app/engine/ttft.py): the estimated seconds to the first token,
    # and those its own prompt takes on an idle pool; None where nothing was estimated (no pace yet, resumed)
    ttft_estimate_s: float | None = None
    own_ttft_s: float | None = None

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
    def uncomputed_tokens(self) -> int:
        """Tokens still to compute before its next token can be sampled: its prompt (or, preempted or
        resumed, prompt and output so far) until computed, then 1 (a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def decoding(self) -> bool:
        """Through its prompt: each step computes its one next token (a decode row)."""
        return self.uncomputed_tokens <= 1

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    @property
    def predicted_remaining_tokens(self) -> int:
        return max(self.predicted_output_tokens - self.num_output_tokens, 1)

    @property
    def rank_remaining_tokens(self) -> float:
        """Predicted tokens still to generate, by the ranking estimate while it holds (never past
        ``max_tokens``: an answer ends there whatever the prompt suggests); an answer that outgrew
        it falls back to the bound (not to "one token left" forever)."""
        rank = self.prediction.rank_tokens
        if rank is None or self.num_output_tokens >= rank:
            return self.predicted_remaining_tokens
        return max(min(rank, self.sampling.max_tokens) - self.num_output_tokens, 1)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) of prompt + output."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
