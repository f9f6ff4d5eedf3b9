"""Engine items → OpenAI chat completion and (text) completion objects and SSE events (pure; no Ray)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from app.api.completions import Completion, CompletionChoice
from app.api.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    Delta,
    ResponseMessage,
    Usage,
)


class ChatResult:
    """One answer as it accumulates from the engine's items (text deltas, token counts, timing)."""

    def __init__(self, request_id: str, model: str, tier: str, t0: float, first: dict) -> None:
        self.request_id = request_id
        self.model = model
        self.tier = tier
        self.t0 = t0
        self.first = first
        self.created = int(time.time())
        self.ttft_s = time.perf_counter() - t0
        self.parts: list[str] = []
        self.prompt_tokens = first["prompt_tokens"]
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # what the engine generated so far (to resume on another replica)
        self.finish_reason: str | None = None
        self.sent_role = False

    def add(self, item: dict) -> None:
        self.parts.append(item["text"])
        self.token_ids.extend(item.get("token_ids") or ())
        self.completion_tokens = item["completion_tokens"]
        if item["finished"]:
            self.finish_reason = "length" if item["finish_reason"] == "length" else "stop"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)

    @property
    def service_tier(self) -> str:
        return "flex" if self.tier == "flex" else "default"


def completion(result: ChatResult) -> ChatCompletion:
    return ChatCompletion(
        id=result.request_id, created=result.created, model=result.model, usage=result.usage,
        choices=[Choice(message=ResponseMessage(content=result.text), finish_reason=result.finish_reason)],
        service_tier=result.service_tier,
    )


def _event(result: ChatResult, choices: list[ChunkChoice], usage: Usage | None = None) -> str:
    chunk = ChatCompletionChunk(id=result.request_id, created=result.created, model=result.model,
                                choices=choices, usage=usage, service_tier=result.service_tier)
    return "data: " + json.dumps(chunk.model_dump(exclude_none=True)) + "\n\n"


def sse_chunks(result: ChatResult, item: dict, include_usage: bool) -> Iterator[str]:
    """The SSE events for one engine item (already added to ``result``): the role on the first,
    the text delta if any, then the finish reason and (if asked) a usage-only chunk on the last."""
    if not result.sent_role:
        result.sent_role = True
        yield _event(result, [ChunkChoice(delta=Delta(role="assistant", content=""))])
    if item["text"]:
        yield _event(result, [ChunkChoice(delta=Delta(content=item["text"]))])
    if item["finished"]:
        yield _event(result, [ChunkChoice(delta=Delta(), finish_reason=result.finish_reason)])
        if include_usage:
            yield _event(result, [], usage=result.usage)


def text_completion(result: ChatResult) -> Completion:
    return Completion(id=result.request_id, created=result.created, model=result.model, usage=result.usage,
                      choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
                      service_tier=result.service_tier)


def text_sse_chunks(result: ChatResult, item: dict, include_usage: bool) -> Iterator[str]:
    """The SSE events of a streamed completion for one engine item: its text, the finish reason on
    the last, then (if asked) a usage-only event."""
    result.sent_role = True  # NOTE: the answer has started streaming (``_cancel_unstarted``)

    def event(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        chunk = Completion(id=result.request_id, created=result.created, model=result.model, choices=choices,
                           usage=usage, service_tier=result.service_tier).model_dump(exclude_none=True)
        chunk["choices"] = [c.model_dump() for c in choices]  # OpenAI's nulls kept: finish_reason, logprobs
        return "data: " + json.dumps(chunk) + "\n\n"

    if item["text"] or item["finished"]:
        finish = result.finish_reason if item["finished"] else None
        yield event([CompletionChoice(text=item["text"], finish_reason=finish)])
    if item["finished"] and include_usage:
        yield event([], usage=result.usage)
