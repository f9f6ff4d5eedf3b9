"""Training and evaluation examples: ShareGPT traces, feedback records and user JSONL files.

An example is what the predictor sees (the user's message text) and what it must guess (the
output length in the serving model's tokens). The trace's reserved split is never read: only
``train`` and ``validation`` exist here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    output_tokens: int


class EvalLine(BaseModel):
    """One line of an evaluation file (``foreserve predictor eval --data``)."""

    prompt: str = Field(min_length=1, description="The user message text.")
    output_tokens: int = Field(ge=0, description="True output length in the serving model's tokens.")


TRACE_SPLITS = ("train", "validation", "train_later")


def trace_examples(trace_dir: Path, split: str) -> list[Example]:
    """``train``, ``validation`` or ``train_later`` from the traces ``foreserve prepare`` builds in
    ``trace_dir``: ``<split>.jsonl``, one JSON object per line with the ``user`` text and its true
    ``output_tokens`` (docs/predictor.md)."""
    if split not in TRACE_SPLITS:
        raise ValueError(f"unknown trace split {split!r}; choose from {', '.join(TRACE_SPLITS)}")
    with open(Path(trace_dir) / f"{split}.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Example(r["user"], int(r["output_tokens"])) for r in rows]


def training_examples(trace_dir: Path, turns: str = "all") -> list[Example]:
    """The train split's first turns and, with ``turns="all"``, the later turns of the same
    conversations (``train_later``) minus any whose text is also a validation prompt, so that the
    selection set stays unseen."""
    if turns not in ("all", "first"):
        raise ValueError(f"turns is 'all' or 'first', got {turns!r}")
    first = trace_examples(trace_dir, "train")
    if turns == "first":
        return first
    validation = {e.text.strip() for e in trace_examples(trace_dir, "validation")}
    return first + [e for e in trace_examples(trace_dir, "train_later") if e.text.strip() not in validation]


def selection_examples(trace_dir: Path) -> list[Example]:
    """The validation split minus prompts that also occur in train (ShareGPT repeats popular
    prompts across conversations): model selection must be on data never trained on."""
    seen = {e.text.strip() for e in trace_examples(trace_dir, "train")}
    out, kept = [], set()
    for e in trace_examples(trace_dir, "validation"):
        key = e.text.strip()
        if key not in seen and key not in kept:
            kept.add(key)
            out.append(e)
    return out


def is_censored(record, max_tokens: int = 1024) -> bool:
    """Cut by the request's own ``max_tokens`` below the predictor's: the answer was at least this long."""
    return record.finish_reason == "length" and record.output_tokens < max_tokens


def feedback_examples(records: Iterable, max_tokens: int = 1024) -> list[Example]:
    """Feedback records that carry the model's true length: finished by EOS or a stop string, or cut
    at ``max_tokens`` or beyond. A cut below it only says "longer than", an abort says nothing, and a
    request that ignored EOS ran to the client's length, not the model's."""
    return [
        Example(r.prompt, r.output_tokens)
        for r in records
        if r.prompt and not r.ignore_eos and r.finish_reason in ("stop", "length") and not is_censored(r, max_tokens)
    ]


def read_eval_file(path: Path) -> list[Example]:
    """A JSONL of ``{"prompt", "output_tokens"}``; a bad line fails with its line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such evaluation file: {path}")
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                item = EvalLine.model_validate(json.loads(line))
            except (json.JSONDecodeError, ValidationError) as exc:
                raise ValueError(f"{path}:{lineno}: not a {{prompt, output_tokens}} line: {exc}") from None
            out.append(Example(item.prompt, item.output_tokens))
    if not out:
        raise ValueError(f"{path} holds no examples")
    return out


def examples_hash(examples: Iterable[Example]) -> str:
    """A short content hash: two metric sets compare only when their eval sets hash alike."""
    h = hashlib.sha256()
    for e in examples:
        h.update(e.text.encode("utf-8"))
        h.update(b"\x00")
        h.update(str(e.output_tokens).encode())
        h.update(b"\x01")
    return h.hexdigest()[:16]
