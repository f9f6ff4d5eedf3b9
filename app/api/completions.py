"""OpenAI's (legacy) completions API, ``POST /v1/completions``: a prompt continued as it is, for a
base model (no chat template) or a client that formats its own prompt. The same rules as the chat
schema (``schemas.py``): strict types, unknown fields ignored, values foreserve cannot honour a 400."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from app.api.schemas import GenerationRequest, Usage

TokenId = Annotated[int, Field(ge=0)]
UNSUPPORTED = {"echo": (False,), "suffix": ("",), "best_of": (1,), "logprobs": (0,), "logit_bias": ({},),
               "presence_penalty": (0,), "frequency_penalty": (0,)}


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions`` body: one prompt, as text or token ids."""

    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(description="One prompt: text, or token ids.")
    max_tokens: int | None = Field(16, ge=1, description="Upper bound on generated tokens (OpenAI's default 16); null: up to the context.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("one prompt per request is supported; send separate requests")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def predictor_text(self, tokenizer) -> str:
        """What the length predictor reads: the prompt, token ids decoded (those past the tokenizer's
        vocabulary left out: ``text_prompt`` refuses them)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return tokenizer.decode([i for i in self.prompt if i < len(tokenizer)])


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class Completion(BaseModel):
    """The answer, and (``stream``) each SSE event, whose usage-only last one has ``choices == []``."""

    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    service_tier: str | None = None
