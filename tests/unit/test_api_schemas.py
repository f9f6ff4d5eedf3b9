"""OpenAI request validation and response shapes, checked against the official client's types."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk
from pydantic import ValidationError

from app.api.errors import APIError, from_validation_error, overloaded
from app.api.schemas import (
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChunkChoice, Delta, ResponseMessage, Usage,
)

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**OK, **kw})


def error_of(body: dict) -> APIError:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    return from_validation_error(info.value)


def test_features_left_off_are_accepted():
    off = req(tools=[], tool_choice="none", response_format={"type": "text"}, logprobs=False, top_logprobs=0,
              logit_bias={}, presence_penalty=0, frequency_penalty=0.0, metadata={"k": "v"})
    assert off.pool == "online"


def test_defaults_tiers_and_text():
    r = req(messages=[{"role": "developer", "content": "be brief"},
                      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            unknown_field=1)
    assert r.pool == "online" and r.predictor_text() == "ab" and r.requested_max_tokens() is None
    assert r.chat_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert req(service_tier="flex").pool == "offline" and req(service_tier="priority").pool == "online"
    assert req(stop="x").stop_list == ("x",) and req(max_tokens=5).requested_max_tokens() == 5


@pytest.mark.parametrize("body,param,fragment", [
    ({"model": "m", "messages": []}, "messages", "at least 1"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'user'"),
    ({"model": "m", "messages": [{"role": "system", "content": "only system"}]}, "messages", "non-empty user message"),
    ({**OK, "n": 2}, "n", "n > 1 is not supported"),
    ({**OK, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**OK, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({**OK, "top_p": 0}, "top_p", "greater than 0"),
    ({**OK, "service_tier": "gold"}, "service_tier", "flex"),
    ({**OK, "seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools is not supported"),
    ({**OK, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({**OK, "logprobs": True}, "logprobs", "not supported"),
    ({**OK, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ({"messages": OK["messages"]}, "model", "required"),
    # strict types, as OpenAI's API: no coercion of strings, numbers or ints to booleans
    ({**OK, "stream": "yes"}, "stream", "valid boolean"),
    ({**OK, "stream": 1}, "stream", "valid boolean"),
    ({**OK, "max_tokens": "12"}, "max_tokens", "valid integer"),
    ({**OK, "max_tokens": 12.5}, "max_tokens", "valid integer"),
    ({**OK, "temperature": "0.5"}, "temperature", "valid number"),
    ({**OK, "n": True}, "n", "valid integer"),
    ({**OK, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage", "valid boolean"),
    ({**OK, "model": 7}, "model", "valid string"),
])
def test_bad_input_becomes_a_400_naming_the_field(body, param, fragment):
    err = error_of(body)
    assert err.status_code == 400 and err.param == param and fragment in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_429_carries_retry_after():
    err = overloaded(3, "online")
    assert err.status_code == 429 and err.headers == {"Retry-After": "3"}
    assert err.body()["error"]["type"] == "rate_limit_error"


def test_responses_parse_with_the_openai_client_types():
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    full = ChatCompletion(model="m", choices=[Choice(message=ResponseMessage(content="hi"), finish_reason="stop")], usage=usage)
    parsed = OpenAIChatCompletion.model_validate(full.model_dump())
    assert parsed.choices[0].message.content == "hi" and parsed.usage.total_tokens == 5
    chunk = ChatCompletionChunk(id="c", created=0, model="m", choices=[ChunkChoice(delta=Delta(role="assistant", content="h"))])
    assert OpenAIChunk.model_validate(chunk.model_dump()).choices[0].delta.content == "h"
    last = ChatCompletionChunk(id="c", created=0, model="m", choices=[], usage=usage)
    assert OpenAIChunk.model_validate(last.model_dump()).usage.completion_tokens == 2
