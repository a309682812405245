"""Tokenizer, chat templates and incremental detokenization.

Life cycle: `Tokenizer.from_dir` loads `tokenizer.json` (the `tokenizers`
library) and `tokenizer_config.json` (special tokens, chat template). Plain
prompts are encoded with the tokenizer's own special-token handling (as HF
does); chat messages are rendered with the template in a sandboxed jinja2
environment and encoded *without* adding special tokens, because the template
writes them. Each generating request owns an `IncrementalDetokenizer` that
turns new token ids into text deltas, emitting only complete UTF-8 text.

Long texts (`LONG_TEXT` characters and more) are encoded through the library's batch call, which
releases the GIL, so a caller that runs it on a worker thread keeps its event loop turning (megabytes
of prompt take seconds). Given a `limit`, `encode` first counts the tokens of consecutive windows
(cut at whitespace where there is some: a pre-tokenizer that splits there codes each window exactly
as the whole does): once they pass `limit` the text is certainly longer, and `TextTooLong` says so
without encoding the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from edgecore.shared.errors import ConfigError, RequestError


LONG_TEXT = 1 << 16          # characters from which encoding releases the GIL
PREFIX_CHARS_PER_TOKEN = 16  # characters per allowed token in each window checked against a limit
CUT_SLACK = 8                # tokens a window cut inside a word may code differently from the whole


class TextTooLong(RequestError):
    """The text has more than `limit` tokens: at least `at_least` (counted on a prefix)."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text has at least {at_least} tokens, more than {limit}", code="context_length_exceeded")
        self.at_least, self.limit = at_least, limit


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, backend: _HFTokenizer, config: dict[str, Any]):
        self.backend = backend
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self._template: Template | None = None
        self.special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        if str(model_dir).endswith(".gguf"):     # the file's own tokenizer, or a tokenizer.json beside it
            from edgecore.shared.text.gguf_tokenizer import tokenizer_for_gguf
            return tokenizer_for_gguf(model_dir)
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"model directory {model_dir} has no tokenizer.json")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise ConfigError(f"{path} cannot be loaded: {exc}") from None
        config = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{cfg_path} is not valid JSON: {exc}") from None
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file() and not config.get("chat_template"):
            config["chat_template"] = template_file.read_text()
        return cls(backend, config)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of `text`; with `limit`, raises `TextTooLong` early for a text that is certainly longer
        (its ids are then never all computed)."""
        if limit is not None and len(text) > 2 * PREFIX_CHARS_PER_TOKEN * limit:
            at_least = self._at_least(text, limit, add_special_tokens)
            if at_least > limit:
                raise TextTooLong(at_least, limit)
        return self._encode(text, add_special_tokens)

    def _at_least(self, text: str, limit: int, add_special_tokens: bool) -> int:
        """A lower bound on the tokens of `text`, from consecutive windows encoded apart until it passes
        `limit` (or one window of text is left). Windows end at whitespace where there is some (a whitespace
        pre-tokenizer codes them exactly as the whole does); a window cut inside a word may code its edge
        differently, so each cut is allowed `CUT_SLACK` tokens."""
        window = PREFIX_CHARS_PER_TOKEN * limit
        count, start = 0, 0
        while len(text) - start > window and count <= limit:
            end = start + window
            cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            slack = 0 if cut > start else CUT_SLACK
            cut = cut if cut > start else end
            count += max(0, len(self._encode(text[start:cut], add_special_tokens and start == 0)) - slack)
            start = cut
        return count

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < LONG_TEXT:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids   # GIL released

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **extra: Any) -> str:
        if not self.chat_template:
            raise RequestError("this model has no chat template; use /v1/completions", param="messages")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "", **extra)
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # what a template's own code raises on input it did not expect (a wrong type in a message or a
            # template variable): the request's fault, not the server's
            raise RequestError(f"chat template failed: {type(exc).__name__}: {exc}", param="messages") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, limit: int | None = None,
                    **extra: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False, limit=limit)


def _raise_template_error(message: str) -> NoReturn:
    raise TemplateError(message)


class IncrementalDetokenizer:
    """Token ids in, text deltas out; holds back bytes that do not yet form complete UTF-8.

    Decodes only a short window (a few context tokens plus the unread ones),
    so each step costs O(1) in the length of the output.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # incomplete UTF-8 sequence (or nothing visible yet)
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (may contain U+FFFD)."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
