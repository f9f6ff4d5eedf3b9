"""The subset of OpenAI's chat completions API that foreserve serves, validated with pydantic.

Unknown fields are accepted and ignored (clients send many); values we cannot honour (n > 1,
non-text content, tools, JSON mode, logprobs, logit bias, penalties) are rejected with a clear
message rather than silently ignored. Types are strict, as OpenAI's API: ``"stream": "yes"``,
``"max_tokens": "12"`` or ``"n": true`` are a 400 naming the field, not coerced.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED = {  # OpenAI fields foreserve does not implement, and the values that leave them off
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
    "response_format": ({"type": "text"},), "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},),
    "presence_penalty": (0,), "frequency_penalty": (0,),
}
# service_tier -> pool. OpenAI's own names: "flex" is its cheaper, slower tier.
TIER_TO_POOL = {None: "online", "auto": "online", "default": "online", "priority": "online", "flex": "offline"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """What a chat and a (text) completion request share: the model, sampling, streaming, stops,
    the tier, and the refusal of features foreserve does not implement (``unsupported``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED

    model: str = Field(min_length=1, description="Served model id (see GET /v1/models).")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="int64, as OpenAI's.")
    ignore_eos: bool = Field(False, description="vLLM's extension: keep generating past EOS up to max_tokens (benchmarks).")
    service_tier: Literal["auto", "default", "priority", "flex"] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported; send separate requests")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stop

    @model_validator(mode="after")
    def _no_unsupported_features(self):
        """Tools, JSON mode, logprobs, logit bias and penalties are not implemented: a request that
        asks for them gets a 400 naming the field, not plain text that ignored them."""
        extra = self.model_extra or {}
        for name, off in self.unsupported.items():
            value = extra.get(name)
            if value is not None and value not in off:
                raise PydanticCustomError("unsupported", "{param} is not supported by this server", {"param": name})
        return self

    @property
    def pool(self) -> str:
        """``online`` (default/priority) or ``offline`` (flex)."""
        return TIER_TO_POOL[self.service_tier]

    @property
    def tier(self) -> str:
        """The metrics' tier name: ``flex`` for the offline pool, ``online`` otherwise."""
        return "flex" if self.pool == "offline" else "online"

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far; at least one message.")
    max_tokens: int | None = Field(None, ge=1, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Upper bound on generated tokens.")

    @field_validator("messages")
    @classmethod
    def _has_user(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.role == "user" and m.text.strip() for m in messages):
            raise ValueError("messages must contain a non-empty user message")
        return messages

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def predictor_text(self, tokenizer=None) -> str:
        """What the length predictor reads: the last user message (``tokenizer``: unused, as
        ``CompletionRequest.predictor_text`` takes it)."""
        return next(m.text for m in reversed(self.messages) if m.role == "user" and m.text.strip())

    def chat_messages(self) -> list[dict]:
        """Messages as the tokenizer's chat template wants them (developer -> system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in self.messages]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    service_tier: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event; the usage-only chunk has ``choices == []`` (OpenAI's include_usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "foreserve"
    max_model_len: int | None = None  # the longest prompt + answer served (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
