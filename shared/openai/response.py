"""OpenAI response bodies from engine outputs (non-streaming), shared by the edge API and batches.

Life cycle: a caller collects each choice's `RequestOutput`s into a
`ChoiceResult` (`add`), then `response_body` picks the choices returned (all,
or the best by cumulative logprob with `best_of`) and builds the JSON object
OpenAI returns (chat with tools: the text split into content and
`tool_calls`, finish_reason "tool_calls"), logprobs (prompt logprobs with `echo`, vLLM's
`prompt_logprobs`) and usage included. Token strings come from
`TokenText`, a cached id → text map.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from edgecore.shared.engine.output import RequestOutput, TokenLogprob
from edgecore.shared.openai.request import ParsedRequest
from edgecore.shared.text.token_bytes import TokenBytes
from edgecore.shared.text.tokenizer import Tokenizer


class TokenText:
    """Tokens as logprobs show them: the text of each alone (U+FFFD for part of a character), its raw bytes
    (`TokenBytes`), and offsets into the text they decode to together."""

    def __init__(self, tokenizer: Tokenizer):
        @lru_cache(maxsize=65536)
        def text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)
        self.text = text
        self._tokenizer = tokenizer
        self._bytes: Callable[[int], bytes] | None = None

    def bytes(self, token_id: int) -> bytes:
        if self._bytes is None:          # built when first asked: a node may serve a model without a tokenizer
            self._bytes = TokenBytes(self._tokenizer).of
        return self._bytes(token_id)

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int = 0) -> dict:
        """`text_offset`: where each token starts in the text, in characters of the tokens' bytes decoded
        together (U+FFFD for invalid bytes; a token inside a character that takes several tokens: where that
        character starts). Linear in the tokens."""
        return self._logprobs(lps, offset)[0]

    def _logprobs(self, lps: list[TokenLogprob], offset: int) -> tuple[dict, int]:
        """(the completions logprobs object, the offset after the last token)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for lp in lps:
            tokens.append(self.text(lp.token_id))
            token_lps.append(lp.logprob)
            tops.append({self.text(t): v for t, v in lp.top})
            offsets.append(offset)
            offset += len(decoder.decode(self.bytes(lp.token_id)))
        offset += len(decoder.decode(b"", final=True))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def echo_logprobs(self, plps: list[TokenLogprob | None], lps: list[TokenLogprob]) -> dict:
        """Completions `echo` + `logprobs`: the prompt tokens' entries (the first has none), then the output's.
        (Offsets count the tokens' bytes: with a tokenizer that strips a leading space when decoding, as
        SentencePiece's do, they run one character ahead of the echoed text.)"""
        prompt, offset = self._logprobs([lp for lp in plps if lp is not None], 0)
        return {key: prompt[key] + value for key, value in self.completion_logprobs(lps, offset).items()}

    def prompt_logprobs(self, plps: list[TokenLogprob | None]) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for the
        token itself and the top alternatives (None for the first token)."""
        out: list[dict | None] = []
        for lp in plps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.text(t)}
                     for r, (t, v) in enumerate(lp.top)}
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank,
                                       "decoded_token": self.text(lp.token_id)}
            out.append(entry)
        return out

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        content = []
        for lp in lps:
            s = self.text(lp.token_id)
            content.append({"token": s, "logprob": lp.logprob, "bytes": list(self.bytes(lp.token_id)),
                            "top_logprobs": [{"token": self.text(t), "logprob": v,
                                              "bytes": list(self.bytes(t))} for t, v in lp.top]})
        return {"content": content}


@dataclass
class ChoiceResult:
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    cached_tokens: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> None:
        if self.cached_tokens is None:
            self.cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.new_text
        self.tokens += len(out.new_token_ids)
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(parsed: ParsedRequest, completion_tokens: int, cached: int) -> dict:
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def usage_so_far(parsed: ParsedRequest, i: int, tokens: int) -> dict:
    """vLLM's continuous usage (`stream_options.continuous_usage_stats`) in a streamed chunk of choice `i`: its
    prompt's tokens and the `tokens` it has generated so far."""
    prompt_tokens = len(parsed.prompts[i // parsed.n])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}


def best_of(parsed: ParsedRequest, results: list[ChoiceResult]) -> list[tuple[int, ChoiceResult]]:
    """(prompt index, result) of the choices returned: all of them, or with `best_of` the `keep` best of each
    prompt's `n` by cumulative logprob (stable: ties keep generation order)."""
    n, keep = parsed.n, parsed.returned
    chosen = []
    for p in range(len(parsed.prompts)):
        group = results[p * n:(p + 1) * n]
        if keep < n:
            group = sorted(group, key=lambda r: -sum(lp.logprob for lp in r.logprobs))[:keep]
        chosen += [(p, r) for r in group]
    return chosen


def response_body(parsed: ParsedRequest, results: list[ChoiceResult], chat: bool, rid: str, created: int,
                  model: str, texts: TokenText, fingerprint: str | None = None) -> dict:
    choices = []
    for i, (p, r) in enumerate(best_of(parsed, results)):
        if chat:
            message: dict = {"role": "assistant", "content": r.text}
            reason = r.finish_reason
            if parsed.tools is not None:
                content, calls = parsed.tools.split(r.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": i, "message": message,
                            "logprobs": texts.chat_logprobs(r.logprobs) if parsed.logprobs is not None else None,
                            "finish_reason": reason})
        else:
            prefix = parsed.prompt_texts[p] if parsed.echo else ""
            logprobs = None
            if parsed.logprobs is not None:
                logprobs = texts.echo_logprobs(r.prompt_logprobs or [], r.logprobs) if parsed.echo \
                    else texts.completion_logprobs(r.logprobs)
            choices.append({"index": i, "text": prefix + r.text, "logprobs": logprobs,
                            "finish_reason": r.finish_reason})
            if parsed.extra.get("prompt_logprobs"):
                choices[-1]["prompt_logprobs"] = texts.prompt_logprobs(r.prompt_logprobs or [])
    cached = sum(results[p * parsed.n].cached_tokens or 0 for p in range(len(parsed.prompts)))
    body: dict = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(parsed, sum(r.tokens for r in results), cached),
            "system_fingerprint": fingerprint}
    if chat and parsed.extra.get("prompt_logprobs"):    # vLLM: one prompt, so one list beside the choices
        body["prompt_logprobs"] = texts.prompt_logprobs(results[0].prompt_logprobs or [])
    return body
