"""chat_prompt and text_prompt: the prompt's tokens and the output budget every front end (ingress,
batch jobs) uses, for a chat and for a completion's prompt."""

from __future__ import annotations

import pytest

from app.api.errors import APIError
from app.api.completions import CompletionRequest
from app.api.prompt import chat_prompt, text_prompt
from app.api.schemas import ChatCompletionRequest
from app.config import EngineConfig


class WordTokenizer:
    """One token per word of the templated text."""

    chat_template = "words"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages) + " assistant:"

    def encode(self, text, add_special_tokens=False):
        return list(range(len(text.split())))


def body(words: int, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": " ".join(["w"] * words)}], **extra})


def test_default_max_tokens_fits_what_is_left_of_the_limit():
    tok = WordTokenizer()
    assert chat_prompt(tok, body(9), 2048, 1024) == (list(range(10)), 1024)
    assert chat_prompt(tok, body(9), 500, 1024)[1] == 490  # the limit minus the prompt's 10 tokens
    assert chat_prompt(tok, body(9, max_tokens=7), 500, 1024)[1] == 7


def test_past_the_limit_is_a_400_naming_what_the_client_sent():
    tok = WordTokenizer()
    with pytest.raises(APIError) as err:
        chat_prompt(tok, body(99), 100, 1024)
    assert (err.value.status_code, err.value.param, err.value.code) == (400, "messages", "context_length_exceeded")
    with pytest.raises(APIError) as err:
        chat_prompt(tok, body(9, max_tokens=91), 100, 1024)
    assert (err.value.status_code, err.value.param) == (400, "max_tokens")
    assert chat_prompt(tok, body(9, max_tokens=90), 100, 1024)[1] == 90


def test_sequence_limit_is_the_kv_pool_where_it_is_smaller_than_the_context():
    assert EngineConfig(kv_cache_tokens=8192).sequence_limit_tokens() == 2048  # max_model_len
    small = EngineConfig(kv_cache_tokens=1000, block_size_tokens=16)
    assert small.sequence_limit_tokens() == 992  # whole blocks
    # a request that names no max_tokens on that pool gets what its KV can hold, not a 400 for 1,024
    assert chat_prompt(WordTokenizer(), body(99), small.sequence_limit_tokens(), small.default_max_tokens)[1] == 892


def test_a_chat_on_a_model_without_a_template_is_a_400_naming_chat_template():
    class BaseModelTokenizer(WordTokenizer):
        chat_template = None

    with pytest.raises(APIError) as err:
        chat_prompt(BaseModelTokenizer(), body(3), 2048, 1024)
    assert err.value.status_code == 400 and "`chat_template:`" in err.value.message and "/v1/completions" in err.value.message


def test_a_completions_prompt_as_text_or_ids_and_its_budget():
    class Vocab(WordTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [7] * add_special_tokens + list(range(len(text.split())))

        def __len__(self):
            return 100

    tok = Vocab()
    text = CompletionRequest.model_validate({"model": "m", "prompt": "a b c"})
    assert text_prompt(tok, text, 2048, 1024) == ([7, 0, 1, 2], 16)  # BOS as the tokenizer adds it; OpenAI's 16
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6]], "max_tokens": None})
    assert text_prompt(tok, ids, 10, 1024) == ([5, 6], 8)
    with pytest.raises(APIError, match=r"in \[0, 100\)"):
        text_prompt(tok, CompletionRequest.model_validate({"model": "m", "prompt": [5, 100]}), 10, 1024)
    with pytest.raises(APIError) as err:
        text_prompt(tok, CompletionRequest.model_validate({"model": "m", "prompt": "a b", "max_tokens": 8}), 10, 1024)
    assert (err.value.param, err.value.code) == ("max_tokens", "context_length_exceeded")


@pytest.mark.parametrize("extra,match", [({"n": 2}, "n > 1"), ({"prompt": ["a", "b"]}, "one prompt per request"),
                                         ({"prompt": []}, "must not be empty"), ({"echo": True}, "echo"),
                                         ({"best_of": 2}, "best_of"), ({"logprobs": 1}, "logprobs")])
def test_completions_refuse_what_they_cannot_honour(extra, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        CompletionRequest.model_validate({"model": "m", "prompt": "a", **extra})
