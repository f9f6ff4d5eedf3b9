"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations


class Detokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of tokens before the new ones so that multi-token characters and
    leading-space rules come out right; holds back a delta that ends in an incomplete UTF-8
    character (U+FFFD) until the next token completes it.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens already turned into text
        self._hold = max((len(s) for s in stop), default=1) - 1  # chars that may start a stop string
        self._emitted = 0  # chars of self.text already returned

    def resume(self, token_ids: list[int], emitted_chars: int) -> None:
        """Continue after ``token_ids`` whose first ``emitted_chars`` characters the client already has
        (an answer resumed on another replica): the rest, e.g. text held back for a stop string, is
        still to come. Tokens that end in an incomplete character stay unread."""
        read = len(token_ids)
        while read and self.tokenizer.decode(token_ids[:read], skip_special_tokens=True).endswith("\ufffd"):
            read -= 1
        self.text = self.tokenizer.decode(token_ids[:read], skip_special_tokens=True)
        self._prefix, self._read = max(read - 4, 0), read
        self._emitted = min(emitted_chars, len(self.text))

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Consume all tokens so far; return (new text, stop string hit)."""
        decode = self.tokenizer.decode
        prev = decode(token_ids[self._prefix : self._read], skip_special_tokens=True)
        cur = decode(token_ids[self._prefix :], skip_special_tokens=True)
        if cur.endswith("\ufffd"):
            return "", False
        self.text += cur[len(prev) :]
        self._prefix, self._read = max(self._read - 4, 0), len(token_ids)
        for s in self.stop:
            idx = self.text.find(s, max(self._emitted - len(s), 0))
            if idx != -1:
                self.text = self.text[:idx]
                return self._flush(len(self.text)), True
        return self._flush(len(self.text) - self._hold if self.stop else len(self.text)), False

    def finish(self) -> str:
        """Release any text held back for stop matching."""
        return self._flush(len(self.text))

    def _flush(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta


class FinalText:
    """The text of a request whose caller wants only the finished answer (a batch row): no
    per-token decoding, one decode of every output token at the end. Same interface as
    ``Detokenizer``; without stop strings to watch for (those need the incremental text)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_ids: list[int] = []

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        self._token_ids = token_ids
        return "", False

    def finish(self) -> str:
        return self.tokenizer.decode(self._token_ids, skip_special_tokens=True)
