"""Fixed-shape workloads (``--shape PROMPT_TOKENS:OUTPUT_TOKENS``), as ``vllm bench serve`` and
``guidellm`` send them: each request's user message is exactly PROMPT_TOKENS tokens of the served
model's tokenizer (real text, cut from ShareGPT's prompts at a seeded offset, so no two prompts share
more than the chat template), and it asks for exactly OUTPUT_TOKENS (``ignore_eos``). Several shapes
mix: each request draws one, uniformly. The chat template adds its own tokens to every prompt, the
same for every server under test."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from pydantic import BaseModel, Field

MAX_FIXES = 8  # re-encoding a cut may merge or split a token at its ends: moves of its end, then of its start


class Shape(BaseModel):
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)

    def __str__(self) -> str:
        return f"{self.prompt_tokens}:{self.output_tokens}"


def parse_shape(text: str) -> Shape:
    """``256:128`` → Shape; a clear ValueError on anything else."""
    prompt, sep, output = text.strip().partition(":")
    try:
        if not sep:
            raise ValueError
        return Shape(prompt_tokens=int(prompt), output_tokens=int(output))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected PROMPT_TOKENS:OUTPUT_TOKENS, two whole numbers >= 1, "
                         "e.g. 256:128") from None


class Tokenizer:
    """What a shaped workload needs of a tokenizer: ``encode`` (no special tokens) and ``decode``."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> None:
        self.encode, self.decode = encode, decode

    @classmethod
    def from_pretrained(cls, folder: str) -> "Tokenizer":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        return cls(lambda text: tok.encode(text, add_special_tokens=False), tok.decode)


def exact_text(tokenizer: Tokenizer, ids: list[int], start: int, tokens: int) -> str:
    """Text cut from ``ids`` at ``start`` (or a little after) that encodes to exactly ``tokens``
    tokens: a cut can merge with its neighbour when re-encoded, so its end is moved until the count
    holds, and where it never does (two ends that merge either way) the start is moved."""
    text = tokenizer.decode(ids[start:start + tokens])
    for begin in range(start, start + MAX_FIXES):
        end = begin + tokens
        for _ in range(MAX_FIXES):
            text = tokenizer.decode(ids[begin:end])
            got = len(tokenizer.encode(text))
            if got == tokens:
                return text
            end += tokens - got
    return text


def shaped_items(shapes: Sequence[Shape], count: int, corpus: Sequence[str], tokenizer: Tokenizer, seed: int,
                 tier_of: Callable[[random.Random], str] = lambda rng: "online") -> list[dict]:
    """``count`` requests ``{prompt, max_tokens, tier, shape}``: each a shape drawn from ``shapes``,
    its prompt cut from ``corpus`` (texts, joined) at a seeded offset."""
    rng = random.Random(seed)
    ids = tokenizer.encode("\n\n".join(corpus))
    longest = max(s.prompt_tokens for s in shapes)
    if len(ids) < 2 * longest + 16:
        raise ValueError(f"the corpus has {len(ids)} tokens: too few to cut prompts of {longest} tokens from")
    items = []
    for _ in range(count):
        shape = rng.choice(list(shapes))
        start = rng.randrange(0, len(ids) - 2 * shape.prompt_tokens - 2 * MAX_FIXES)
        items.append({"prompt": exact_text(tokenizer, ids, start, shape.prompt_tokens), "max_tokens": shape.output_tokens,
                      "tier": tier_of(rng), "shape": str(shape)})
    return items
