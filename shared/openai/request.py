"""OpenAI request bodies → engine work.

Life cycle: the HTTP handler passes the decoded JSON object; `parse_completion`
or `parse_chat` converts it to its schema (`schemas.py`: every type and range
checked there, unsupported parameters rejected; structured output read by
`guided.py`), renders chat messages with
the model's template (tools and tool messages through `tools.py`; a template with no tool format gets
the tools in a system message, `ToolSet.preamble`), tokenizes, checks token ids, `logit_bias` keys and the
context length, and returns a `ParsedRequest`: a list of prompts (token ids) ×
`n` generated choices (`best_of` of them for completions), each with its
`SamplingParams`, and the request's `cache_salt` (vLLM's prefix-cache scope). Every problem raises `ApiError` with the HTTP status, OpenAI
error type, `param` and `code`; nothing here can raise anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from functools import partial
from typing import cast

from jinja2.defaults import DEFAULT_NAMESPACE

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import RequestError
from edgecore.shared.openai.errors import ApiError
from edgecore.shared.openai.guided import guided_spec
from edgecore.shared.openai.tools import ToolSet, render_tool_calls, tool_set
from edgecore.shared.openai.schemas import (MAX_N, MAX_PROMPTS, ChatMessage, ChatRequest, CompletionRequest,
                                           SamplingFields, decode_body)
from edgecore.shared.text.tokenizer import TextTooLong, Tokenizer

__all__ = ["ApiError", "ParsedRequest", "check_model", "parse_chat", "parse_completion", "MAX_N"]


@dataclass
class ParsedRequest:
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: list[SamplingParams]          # one per generated choice (n per prompt, prompt-major)
    n: int                                # choices generated per prompt (best_of when given)
    stream: bool
    include_usage: bool
    logprobs: int | None                  # completions: top-N; chat: top_logprobs (0 = chosen only)
    echo: bool = False
    extra: dict = field(default_factory=dict)
    keep: int = 0                         # choices returned per prompt: the best `keep` of `n` (0: all n)
    prompt_logprobs: int | None = None    # top-N per prompt token (vLLM's prompt_logprobs, or echo+logprobs)
    tools: ToolSet | None = None          # chat with tools: the output is split into content and tool calls
    cache_salt: str | None = None         # the body's `cache_salt` (the server combines it with the key's salt)
    continuous_usage: bool = False        # vLLM's `continuous_usage_stats` (with include_usage): usage in every chunk

    @property
    def returned(self) -> int:
        return self.keep or self.n


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist (this server serves '{served}')", "model",
                       "model_not_found")


def _logit_bias(req: SamplingFields, vocab: int) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= token < vocab:
            raise _bad(f"'logit_bias' keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias",
                       "invalid_value")
        bias[token] = value
    return bias


def _encode(encode: Callable[[], list[int]], max_model_len: int, param: str) -> list[int]:
    """`encode()`'s ids; a text certainly longer than the context (`TextTooLong`, decided on a prefix) is the
    context-length error without encoding all of it."""
    try:
        return encode()
    except TextTooLong as exc:
        raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                   f"at least {exc.at_least} tokens.", param, "context_length_exceeded") from None


def _max_tokens(requested: int | None, default: int | None, prompts: list[list[int]], max_model_len: int,
                prompt_param: str) -> int:
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:
        raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                   f"{longest} tokens.", prompt_param, "context_length_exceeded")
    max_tokens = requested if requested is not None else (default if default is not None
                                                          else max_model_len - longest)
    if longest + max_tokens > max_model_len:
        raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the completion). "
                   f"Please reduce the prompt or the completion length.", "max_tokens", "context_length_exceeded")
    return max_tokens


def _params(req: SamplingFields, prompts: list[list[int]], n: int, max_tokens: int, vocab: int,
            logprobs: int | None, prompt_logprobs: int | None, tools: ToolSet | None = None
            ) -> list[SamplingParams]:
    guided = guided_spec(req)
    if tools is not None and tools.guided is not None:
        if guided is not None:
            raise _bad(f"'tool_choice' {tools.choice!r} cannot be combined with '{guided.param}'", "tool_choice")
        guided = tools.guided
    stop = req.stop or []
    stop = [stop] if isinstance(stop, str) else [s for s in stop if s]
    top_p = 1.0 if req.top_p is None else (req.top_p or 1e-9)
    bias = _logit_bias(req, vocab)
    params = []
    for _ in prompts:
        for j in range(n):
            try:
                params.append(SamplingParams(
                    max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=top_p, top_k=-1 if req.top_k is None else req.top_k,
                    seed=None if req.seed is None else (req.seed + j) % 2 ** 63, stop=stop,
                    stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos),
                    logprobs=logprobs, presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    logit_bias=bias, min_p=req.min_p or 0.0, prompt_logprobs=prompt_logprobs, guided=guided))
            except RequestError as exc:
                raise _bad(str(exc), exc.param, "invalid_value") from None
    return params


def _stream_opts(req: SamplingFields) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage): as vLLM, `continuous_usage_stats` counts only with
    `include_usage`."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    return bool(req.stream), include_usage, continuous


def _completion_prompts(req: CompletionRequest, tokenizer: Tokenizer, vocab: int, max_model_len: int
                        ) -> tuple[list[list[int]], list[str]]:
    prompt = req.prompt
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        raw = [cast("str | list[int]", prompt)]                 # one prompt: a text, or token ids
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) and p for p in prompt):
        raw = cast("list[str | list[int]]", prompt)             # texts, or lists of token ids
    else:
        raise _bad("'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of "
                   "token ids", "prompt", "invalid_type")
    if len(raw) > MAX_PROMPTS:       # a list of token ids is one prompt, however long
        raise _bad(f"at most {MAX_PROMPTS} prompts per request, got {len(raw)}", "prompt", "invalid_value")
    prompts, texts = [], []
    for p in raw:
        if isinstance(p, str):
            ids = _encode(partial(tokenizer.encode, p, limit=max_model_len), max_model_len, "prompt")
            texts.append(p)
        else:
            if any(t >= vocab for t in p):
                raise _bad(f"token ids must be in [0, {vocab})", "prompt", "invalid_value")
            ids = list(p)
            texts.append(tokenizer.decode(ids) if req.echo else "")   # only echo shows the prompt text
        if not ids:
            raise _bad("the prompt is empty", "prompt", "invalid_value")
        prompts.append(ids)
    return prompts, texts


def parse_completion(body: dict, tokenizer: Tokenizer, vocab: int, max_model_len: int) -> ParsedRequest:
    req: CompletionRequest = decode_body(body, CompletionRequest)
    prompts, texts = _completion_prompts(req, tokenizer, vocab, max_model_len)
    n = req.n
    assert n is not None        # decode_body turns a null 'n' into 1
    best_of = req.best_of if req.best_of is not None else n
    if best_of < n:
        raise _bad(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of", "invalid_value")
    if best_of > n and req.stream:
        raise _bad("'best_of' greater than 'n' cannot be streamed", "best_of", "invalid_value")
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    if prompt_logprobs is not None and req.stream:
        raise _bad("prompt logprobs ('prompt_logprobs', or 'echo' with 'logprobs') cannot be streamed by this "
                   "server", "prompt_logprobs" if req.prompt_logprobs is not None else "echo", "invalid_value")
    # best_of ranks choices by cumulative logprob, so those choices compute their tokens' logprobs.
    logprobs = req.logprobs if req.logprobs is not None or best_of == n else 0
    max_tokens = _max_tokens(req.max_tokens, 16, prompts, max_model_len, "prompt")
    params = _params(req, prompts, best_of, max_tokens, vocab, logprobs, prompt_logprobs)
    stream, include_usage, continuous = _stream_opts(req)
    return ParsedRequest(prompts, texts, params, best_of, stream, include_usage, req.logprobs, bool(req.echo),
                         {"prompt_logprobs": req.prompt_logprobs is not None}, n if best_of > n else 0,
                         prompt_logprobs, cache_salt=req.cache_salt, continuous_usage=continuous)


def render_message(msg: ChatMessage, i: int) -> dict:
    content = msg.content if msg.content is not None else ""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise _bad(f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                           f"messages[{i}].content[{j}]", "unsupported_parameter")
        content = "".join(cast(str, part.text) for part in content)     # each checked above
    out: dict = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
    if msg.tool_calls is not None:
        if msg.role != "assistant":
            raise _bad("only assistant messages have 'tool_calls'", f"messages[{i}].tool_calls", "invalid_value")
        out["tool_calls"] = render_tool_calls(msg.tool_calls, i)
    if msg.role == "tool":
        out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    return out


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """`text` at the end of the first message when that is a system message, else as a system message before
    the others."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{first}\n\n{text}" if first else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                          "strftime_now", "limit"}) | frozenset(DEFAULT_NAMESPACE)   # and Jinja's (`namespace`, `range`)


def _template_kwargs(kwargs: dict | None) -> dict:
    """`chat_template_kwargs` (e.g. Qwen3's `enable_thinking`) as extra template variables: names the server
    sets itself are refused, as are names that are not identifiers."""
    for name in kwargs or {}:
        if name in TEMPLATE_OWN or not name.isidentifier() or name.startswith("_"):
            raise _bad(f"'chat_template_kwargs' cannot set {name!r}", "chat_template_kwargs", "invalid_value")
    return dict(kwargs or {})


def parse_chat(body: dict, tokenizer: Tokenizer, vocab: int, max_model_len: int) -> ParsedRequest:
    req: ChatRequest = decode_body(body, ChatRequest)
    tools = tool_set(req, tokenizer.chat_template)
    rendered = [render_message(msg, i) for i, msg in enumerate(req.messages)]
    if tools is not None and tools.json_calls:     # no tool format in the template: the default tool prompt
        rendered = _with_system(rendered, tools.preamble())
    extra = _template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:      # as vLLM: a template variable (gpt-oss's templates read it)
        extra.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        ids = _encode(lambda: tokenizer.encode_chat(rendered, add_generation_prompt=True, limit=max_model_len,
                                                    tools=tools.tools if tools and not tools.json_calls else None,
                                                    **extra),
                      max_model_len, "messages")
    except RequestError as exc:
        raise _bad(str(exc), "messages", "invalid_value") from None
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise _bad("'top_logprobs' requires 'logprobs': true", "top_logprobs", "invalid_value")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(requested, None, [ids], max_model_len, "messages")
    if req.prompt_logprobs is not None and req.stream:
        raise _bad("'prompt_logprobs' cannot be streamed by this server", "prompt_logprobs", "invalid_value")
    assert req.n is not None    # decode_body turns a null 'n' into 1
    params = _params(req, [ids], req.n, max_tokens, vocab, logprobs, req.prompt_logprobs, tools)
    stream, include_usage, continuous = _stream_opts(req)
    return ParsedRequest([ids], [""], params, req.n, stream, include_usage, logprobs,
                         extra={"prompt_logprobs": req.prompt_logprobs is not None},
                         prompt_logprobs=req.prompt_logprobs, tools=tools, cache_salt=req.cache_salt,
                         continuous_usage=continuous)
