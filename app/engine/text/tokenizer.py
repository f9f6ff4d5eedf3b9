"""The serving model's tokenizer without transformers: its ``tokenizer.json`` through ``tokenizers``
and its chat template through a sandboxed jinja2, as transformers' fast tokenizers do.

What the engine, the ingress and the batch stages call (``encode``, ``decode``,
``apply_chat_template``, ``eos_token_id``) gives what ``AutoTokenizer`` gives
(``tests/unit/test_tokenizer.py`` compares them), for ~0.1 s of start-up instead of ~1 s (importing
transformers, then ``AutoTokenizer``). A folder without ``tokenizer.json`` or with a template that
needs transformers' extensions gets ``AutoTokenizer`` (``load_tokenizer``).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

# transformers' cleanup for ``clean_up_tokenization_spaces`` (off unless the tokenizer config asks)
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    """A special token in tokenizer_config.json: a string, or ``{"content": ...}`` in older files."""
    return value.get("content") if isinstance(value, dict) else value


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # NOTE: jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTokenizer:
    """``tokenizers.Tokenizer`` plus the model folder's special tokens and chat template."""

    def __init__(self, tokenizer, special_tokens: dict[str, str], chat_template: str | None, clean_up_spaces: bool = False) -> None:
        self._tok = tokenizer
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.clean_up_spaces = clean_up_spaces
        self.eos_token_id = self._id(special_tokens.get("eos_token"))
        self.bos_token_id = self._id(special_tokens.get("bos_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTokenizer | None":
        """None where the folder needs transformers (no ``tokenizer.json``, a template with its tags)."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if not isinstance(template, (str, type(None))) or (template and re.search(r"\{%-?\s*generation\s*-?%\}", template)):
            return None  # named templates, assistant masks: transformers' business
        special = {key: text for key in _SPECIAL_KEYS if (text := _token_text(config.get(key)))}
        from jinja2 import TemplateSyntaxError

        try:
            return cls(Tokenizer.from_file(str(path / "tokenizer.json")), special, template,
                       bool(config.get("clean_up_tokenization_spaces", False)))
        except TemplateSyntaxError:  # a tag of transformers' own, or a broken template: its error is transformers'
            return None

    def set_chat_template(self, template: str) -> None:
        self.chat_template, self._template = template, _compile_template(template)

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included (as transformers' ``len(tokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs) -> str | list[int]:
        """The rendered conversation (``tokenize=False``) or its token ids, as transformers renders it."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template: send a completion prompt instead")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def template_text(chat_template: str) -> str:
    """A ``chat_template`` setting's Jinja text: the file it names, or the setting itself."""
    if "{" not in chat_template and Path(chat_template).expanduser().is_file():
        return Path(chat_template).expanduser().read_text()
    return chat_template


def load_tokenizer(path: str | Path, chat_template: str = ""):
    """The model folder's tokenizer: ``ChatTokenizer`` where it can, else transformers' ``AutoTokenizer``;
    ``chat_template`` (a Jinja template or a file's path) in place of the folder's own, if given."""
    tokenizer = ChatTokenizer.from_dir(path)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template:
        text = template_text(chat_template)
        if isinstance(tokenizer, ChatTokenizer):
            tokenizer.set_chat_template(text)
        else:
            tokenizer.chat_template = text
    return tokenizer
