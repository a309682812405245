"""OpenAI response bodies from engine outputs (non-streaming), shared by the edge API and batches.

Life cycle: a caller collects each choice's `RequestOutput`s into a
`ChoiceResult` (`add`), then `completion_body` / `chat_body` builds the JSON
object OpenAI returns, logprobs and usage included. Token strings come from
`TokenText`, a cached id → text map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from edgecore.shared.engine.output import RequestOutput, TokenLogprob
from edgecore.shared.openai.request import ParsedRequest
from edgecore.shared.tokenizer import Tokenizer


class TokenText:
    def __init__(self, tokenizer: Tokenizer):
        @lru_cache(maxsize=65536)
        def text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)
        self.text = text

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int = 0) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s = self.text(lp.token_id)
            tokens.append(s)
            token_lps.append(lp.logprob)
            tops.append({self.text(t): v for t, v in lp.top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        content = []
        for lp in lps:
            s = self.text(lp.token_id)
            content.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.text(t), "logprob": v,
                                              "bytes": list(self.text(t).encode())} for t, v in lp.top]})
        return {"content": content}


@dataclass
class ChoiceResult:
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    cached_tokens: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        if self.cached_tokens is None:
            self.cached_tokens = out.num_cached_tokens
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


def response_body(parsed: ParsedRequest, results: list[ChoiceResult], chat: bool, rid: str, created: int,
                  model: str, texts: TokenText, fingerprint: str | None = None) -> dict:
    choices = []
    for i, r in enumerate(results):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": r.text},
                            "logprobs": texts.chat_logprobs(r.logprobs) if parsed.logprobs is not None else None,
                            "finish_reason": r.finish_reason})
        else:
            prefix = parsed.prompt_texts[i // parsed.n] if parsed.echo else ""
            choices.append({"index": i, "text": prefix + r.text,
                            "logprobs": texts.completion_logprobs(r.logprobs, len(prefix))
                            if parsed.logprobs is not None else None,
                            "finish_reason": r.finish_reason})
    cached = sum(results[p * parsed.n].cached_tokens or 0 for p in range(len(parsed.prompts)))
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(parsed, sum(r.tokens for r in results), cached),
            "system_fingerprint": fingerprint}
