"""Parsing and validating OpenAI request bodies into engine work.

Life cycle: the HTTP handler passes the decoded JSON object; `parse_completion`
or `parse_chat` checks every field OpenAI defines (types, ranges), renders chat
messages with the model's template, tokenizes, checks the context length, and
returns a `ParsedRequest`: a list of prompts (token ids) × `n` choices, each
with its `SamplingParams`. Unknown fields are ignored. Every problem raises
`ApiError` with the HTTP status, OpenAI error type, `param` and `code`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.tokenizer import Tokenizer

MAX_N = 16
MAX_STOP = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: list[SamplingParams]          # one per choice (n per prompt)
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None                  # completions: top-N; chat: top_logprobs (0 = chosen only)
    echo: bool = False
    extra: dict = field(default_factory=dict)


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _int(body, key, lo=None, hi=None, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"'{key}' must be an integer, got {type(value).__name__}", key, "invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {value}", key, "invalid_value")
    return value


def _num(body, key, lo, hi, default):
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _bad(f"'{key}' must be a number, got {type(value).__name__}", key, "invalid_type")
    if not lo <= value <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {value}", key, "invalid_value")
    return float(value)


def _bool(body, key, default=False):
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean", key, "invalid_type")
    return value


def _stop(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop", "invalid_type")
    return [s for s in stop if s]


def check_model(body, served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist (this server serves '{served}')", "model",
                       "model_not_found")


def _common(body, tokenizer: Tokenizer, max_model_len: int, prompts: list[list[int]], default_max,
            logprobs: int | None) -> tuple[list[SamplingParams], int]:
    n = _int(body, "n", 1, MAX_N, 1)
    max_tokens = _int(body, "max_completion_tokens", 1, None, None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, None, None)
    temperature = _num(body, "temperature", 0, 2, 1.0)
    top_p = _num(body, "top_p", 0, 1, 1.0)
    if top_p == 0:
        top_p = 1e-9
    top_k = _int(body, "top_k", -1, 2 ** 31 - 1, -1)
    seed = _int(body, "seed", -(2 ** 63), 2 ** 64 - 1, None)
    stop = _stop(body)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or len(stop_ids) > 64 or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 31 for t in stop_ids):
        raise _bad("'stop_token_ids' must be a list of at most 64 token ids (integers from 0 to 2**31-1)",
                   "stop_token_ids", "invalid_value")
    ignore_eos = _bool(body, "ignore_eos")
    for p in ("presence_penalty", "frequency_penalty"):
        _num(body, p, -2, 2, 0.0)
    params = []
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:
        raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                   f"{longest} tokens.", "messages" if "messages" in body else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else max_model_len - longest
    if longest + max_tokens > max_model_len:
        raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the completion). "
                   f"Please reduce the prompt or the completion length.", "max_tokens", "context_length_exceeded")
    for _ in prompts:
        for j in range(n):
            try:
                params.append(SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=None if seed is None else seed + j, stop=stop, stop_token_ids=list(stop_ids),
                    ignore_eos=ignore_eos, logprobs=logprobs))
            except RequestError as exc:
                raise _bad(str(exc), exc.param, "invalid_value") from None
    return params, n


def _stream_opts(body) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = bool(opts.get("include_usage", False))
    return stream, include_usage


def parse_completion(body: dict, tokenizer: Tokenizer, vocab: int, max_model_len: int) -> ParsedRequest:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raw = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt):
        raw = prompt
    else:
        raise _bad("'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of "
                   "token ids", "prompt", "invalid_type")
    if len(raw) > 64:
        raise _bad("at most 64 prompts per request", "prompt", "invalid_value")
    echo = _bool(body, "echo")
    prompts, texts = [], []
    for p in raw:
        if isinstance(p, str):
            ids = tokenizer.encode(p)
            texts.append(p)
        else:
            if any(not 0 <= t < vocab for t in p):
                raise _bad(f"token ids must be in [0, {vocab})", "prompt", "invalid_value")
            ids = list(p)
            texts.append(tokenizer.decode(ids) if echo else "")   # only echo shows the prompt text
        if not ids:
            raise _bad("the prompt is empty", "prompt", "invalid_value")
        prompts.append(ids)
    logprobs = _int(body, "logprobs", 0, 5, None)
    params, n = _common(body, tokenizer, max_model_len, prompts, 16, logprobs)
    stream, include_usage = _stream_opts(body)
    return ParsedRequest(prompts, texts, params, n, stream, include_usage, logprobs, echo)


def _message_text(msg, i) -> tuple[str, str]:
    if not isinstance(msg, dict):
        raise _bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise _bad(f"messages[{i}].role must be system, developer, user, assistant or tool; got {role!r}",
                   f"messages[{i}].role", "invalid_value")
    content = msg.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}] must be a text part", f"messages[{i}].content",
                           "invalid_value")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content",
                   "invalid_type")
    return ("system" if role == "developer" else role), content


def parse_chat(body: dict, tokenizer: Tokenizer, vocab: int, max_model_len: int) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    rendered = [dict(zip(("role", "content"), _message_text(msg, i))) for i, msg in enumerate(messages)]
    try:
        ids = tokenizer.encode_chat(rendered, add_generation_prompt=True)
    except RequestError as exc:
        raise _bad(str(exc), "messages", "invalid_value") from None
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, 20, 0)
    elif body.get("top_logprobs") is not None:
        raise _bad("'top_logprobs' requires 'logprobs': true", "top_logprobs", "invalid_value")
    params, n = _common(body, tokenizer, max_model_len, [ids], None, logprobs)
    stream, include_usage = _stream_opts(body)
    return ParsedRequest([ids], [""], params, n, stream, include_usage, logprobs)
