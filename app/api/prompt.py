"""A request's prompt tokens and output budget: a chat through the model's template, or a
completion's prompt as it is. Shared by the ingress and batch jobs."""

from __future__ import annotations

from app.api import errors
from app.api.completions import CompletionRequest
from app.api.schemas import ChatCompletionRequest

NO_TEMPLATE = ("This model has no chat template, so its chats cannot be formatted: give one with `chat_template:` "
               "in the config's args (a Jinja template or a file's path), or send the prompt to /v1/completions.")


def chat_prompt(tokenizer, body: ChatCompletionRequest, context: int, default_max_tokens: int) -> tuple[list[int], int]:
    """The chat-templated prompt's token ids and the max_tokens to use; ``APIError`` (400) when the
    model has no template or the messages do not fit it or the context."""
    if not getattr(tokenizer, "chat_template", None):
        raise errors.bad_request(NO_TEMPLATE, param="messages")
    try:
        text = tokenizer.apply_chat_template(body.chat_messages(), add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template error is the conversation's fault
        raise errors.bad_request(f"These messages do not fit the model's chat template: {exc}", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, budget(len(ids), body.requested_max_tokens(), context, default_max_tokens, "your messages take")


def text_prompt(tokenizer, body: CompletionRequest, context: int, default_max_tokens: int,
                vocab: int | None = None) -> tuple[list[int], int]:
    """A completion's prompt tokens (text encoded with the tokenizer's BOS, as transformers does; ids as
    sent) and the max_tokens to use; ``APIError`` (400) past the context or the vocabulary (``vocab``:
    the model's embeddings, where fewer than the tokenizer's tokens)."""
    if isinstance(body.prompt, str):
        ids = tokenizer.encode(body.prompt)
    else:
        ids = list(body.prompt)
        vocab = min(len(tokenizer), vocab or len(tokenizer))
        if any(not 0 <= i < vocab for i in ids):
            raise errors.bad_request(f"prompt token ids must lie in [0, {vocab})", param="prompt")
    return ids, budget(len(ids), body.requested_max_tokens(), context, default_max_tokens, "your prompt takes")


def request_prompt(tokenizer, body: ChatCompletionRequest | CompletionRequest, context: int, default_max_tokens: int,
                   vocab: int | None = None) -> tuple[list[int], int]:
    """A request's prompt tokens and max_tokens: a chat through the template, a completion's prompt as
    it is (``vocab``: ``text_prompt``'s)."""
    if isinstance(body, CompletionRequest):
        return text_prompt(tokenizer, body, context, default_max_tokens, vocab)
    return chat_prompt(tokenizer, body, context, default_max_tokens)


def budget(prompt_tokens: int, requested: int | None, context: int, default_max_tokens: int, what: str) -> int:
    """The max_tokens of a prompt of ``prompt_tokens``: ``requested``, else as many as fit, up to the
    default; ``APIError`` (400, ``context_length_exceeded``) where they do not fit ``context``."""
    if prompt_tokens >= context:
        raise errors.bad_request(f"This model's maximum context length is {context} tokens; {what} {prompt_tokens}.",
                                 param="messages" if "messages" in what else "prompt", code="context_length_exceeded")
    if requested is not None and prompt_tokens + requested > context:
        raise errors.bad_request(
            f"This model's maximum context length is {context} tokens; you requested {prompt_tokens + requested} "
            f"({prompt_tokens} in the {'messages' if 'messages' in what else 'prompt'}, {requested} for the completion).",
            param="max_tokens", code="context_length_exceeded")
    return requested or min(default_max_tokens, context - prompt_tokens)
