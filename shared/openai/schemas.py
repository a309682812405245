"""The OpenAI request bodies as msgspec Structs with constraints.

Life cycle: `request.py` converts a decoded JSON object into `ChatRequest` or
`CompletionRequest` with `decode_body`; msgspec checks every type and range at
once, and a failure becomes a 400 `ApiError` whose `param` is the JSON path of
the bad field (`temperature`, `messages[0].role`, `stop_token_ids[2]`).
Unknown fields are ignored (clients send extras); fields the OpenAI API or
vLLM's server define but this server does not implement are declared here too
(`UNSUPPORTED`), so that a non-default value is a 400 naming the parameter
instead of being silently ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from edgecore.shared.openai.errors import ApiError
from edgecore.shared.node.secrets import MAX_CACHE_SALT

MAX_N = 16
MAX_STOP = 4
MAX_PROMPTS = 64

Int64 = Annotated[int, Meta(ge=-(2 ** 63), le=2 ** 63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2 ** 31 - 1)]
Count = Annotated[int, Meta(ge=1, le=2 ** 31 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]


class StreamOptions(Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False     # vLLM's usage in every chunk (with include_usage, as vLLM)


class SamplingFields(Struct, kw_only=True):
    """Fields shared by both endpoints (vLLM's extras included)."""
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = 1     # null: 1, as OpenAI reads it
    max_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2 ** 31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] | None = None
    ignore_eos: bool | None = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(ge=0.01, le=100.0)] | None = None   # as SamplingParams
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=1024)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's prefix-cache scope: cached KV is reused only between requests with the same salt (combined with
    # the API key's own salt, edge/http.py); null: none
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # Structured output (guided.py reads and checks them).
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None          # vLLM's newer form of the four above
    # Known but not implemented: any value other than the default is a 400 naming the field.
    use_beam_search: Any = None
    min_tokens: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    priority: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]   # prompts ≤ MAX_PROMPTS
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    suffix: Any = None
    add_special_tokens: Any = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: Any = None                 # tools.py reads and checks these three
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None   # to the chat template
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    best_of: Any = None
    echo: Any = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None     # extra template variables (request.py checks names)
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    documents: Any = None


# field → values that mean "not used" (accepted); anything else is rejected with a 400.
UNSUPPORTED: dict[str, tuple] = {
    "use_beam_search": (None, False), "min_tokens": (None, 0),
    "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    # vLLM's extras: each default (what this server does) is accepted
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,), "bad_words": (None, []),
    "allowed_token_ids": (None,), "length_penalty": (None, 1.0), "early_stopping": (None, False),
    "logits_processors": (None, []), "return_tokens_as_token_ids": (None, False), "priority": (None, 0),
    "add_special_tokens": (None, True),                      # completions: the tokenizer's own, as vLLM
    "guided_whitespace_pattern": (None,), "guided_decoding_backend": (None,),
}
# Chat only (the completions endpoint implements its own `best_of` and `echo`).
CHAT_UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "chat_template": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "documents": (None,),
}

_PATH = re.compile(r" - at `\$\.?(.*)`$")

_S = TypeVar("_S", bound=Struct)


def _param(path: str) -> str | None:
    path = path.replace("[...]", "")
    return path or None


def decode_body(body: dict, schema: type[_S]) -> _S:
    """`body` as `schema`; a type or range problem is a 400 naming the field by its JSON path."""
    try:
        req = msgspec.convert(body, schema)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        message, path = (text[:match.start()], match.group(1)) if match else (text, "")
        missing = re.match(r"Object missing required field `(.+)`", message)
        if missing:
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
            code = "missing_required_parameter"
        else:
            code = "invalid_type" if message.startswith("Expected `") and "`, got `" in message else "invalid_value"
        param = _param(path)
        raise ApiError(400, f"Invalid value for '{param}': {message}" if param else message, param, code) \
            from None
    if not isinstance(req, SamplingFields):   # /tokenize and the like implement their own fields
        return req
    unsupported = {**UNSUPPORTED, **CHAT_UNSUPPORTED} if schema is ChatRequest else UNSUPPORTED
    for name, accepted in unsupported.items():
        value = getattr(req, name, None)
        if not any(value == a for a in accepted):
            raise ApiError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    if req.stream_options is not None:
        if not req.stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options",
                           "invalid_value")
    if req.n is None:
        req.n = 1
    return req
