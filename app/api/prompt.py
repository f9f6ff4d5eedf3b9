"""A chat request's prompt tokens and output budget: shared by the ingress and batch jobs."""

from __future__ import annotations

from app.api import errors
from app.api.schemas import ChatCompletionRequest


def chat_prompt(tokenizer, body: ChatCompletionRequest, context: int, default_max_tokens: int) -> tuple[list[int], int]:
    """The chat-templated prompt's token ids and the max_tokens to use; ``APIError`` (400) when the
    messages do not fit the template or the context."""
    try:
        text = tokenizer.apply_chat_template(body.chat_messages(), add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template error is the conversation's fault
        raise errors.bad_request(f"These messages do not fit the model's chat template: {exc}", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) >= context:
        raise errors.bad_request(
            f"This model's maximum context length is {context} tokens; your messages take {len(ids)}.",
            param="messages", code="context_length_exceeded")
    requested = body.requested_max_tokens()
    if requested is not None and len(ids) + requested > context:
        raise errors.bad_request(
            f"This model's maximum context length is {context} tokens; you requested {len(ids) + requested} "
            f"({len(ids)} in the messages, {requested} for the completion).",
            param="max_tokens", code="context_length_exceeded")
    return ids, requested or min(default_max_tokens, context - len(ids))
