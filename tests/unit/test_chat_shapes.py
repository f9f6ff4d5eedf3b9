"""The ingress's parts that need no Ray: SSE and completion shapes, the app config (the ingress itself,
which imports Ray Serve: tests/e2e/test_ingress_unit.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.config import AppConfig, load_app_config
from deployments.chat import ChatResult, completion, sse_chunks


def _item(text: str, n: int, finished: bool = False, reason: str | None = None) -> dict:
    return {"text": text, "completion_tokens": n, "prompt_tokens": 7, "finished": finished, "finish_reason": reason}


def test_sse_events_follow_openai_streaming():
    items = [_item("Hel", 1), _item("", 2), _item("lo", 3, True, "length")]
    result = ChatResult("chatcmpl-1", "m", "flex", 0.0, items[0])
    events = []
    for item in items:
        result.add(item)
        events += list(sse_chunks(result, item, include_usage=True))
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]  # the empty delta sends nothing
    assert chunks[3]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    assert chunks[4]["choices"] == [] and chunks[4]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert {c["id"] for c in chunks} == {"chatcmpl-1"} and {c["service_tier"] for c in chunks} == {"flex"}
    body = completion(result).model_dump()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


def test_no_usage_chunk_unless_asked():
    item = _item("ok", 1, True, "stop")
    result = ChatResult("c", "m", "online", 0.0, item)
    result.add(item)
    chunks = [json.loads(e.removeprefix("data: ")) for e in sse_chunks(result, item, include_usage=False)]
    assert [c["choices"][0].get("finish_reason") for c in chunks] == [None, None, "stop"] and "usage" not in chunks[-1]


def test_app_config_loads_the_repository_file_and_checks_pools():
    config = load_app_config()
    assert config.pools["online"].scheduler == "online" and config.pools["offline"].scheduler == "offline"
    with pytest.raises(ValidationError, match="missing"):
        AppConfig.model_validate({"pools": {"online": {}}})
    with pytest.raises(ValidationError, match="same model"):
        AppConfig.model_validate({"pools": {"online": {}, "offline": {"served_model_name": "other"}}})
    with pytest.raises(ValidationError, match="unknown allocation"):
        AppConfig.model_validate({"pools": {"online": {"allocation": "nope"}, "offline": {}}})
