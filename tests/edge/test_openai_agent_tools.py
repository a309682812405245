"""What benchmark and agent tools send: vLLM's `stream_options.continuous_usage_stats` (usage so far in every
streamed chunk) and `tool_choice` "required" / a named function on a model whose chat template has no tool
format (the bundled one): the tools in the default system preamble, the output a grammar-enforced JSON
call, returned as OpenAI `tool_calls`. Parsing units, then an in-process server over a real engine."""

from __future__ import annotations

import json

import aiohttp
import jsonschema
import pytest

from edgecore.edge.http import EdgeHTTP, start_http
from edgecore.shared.openai.request import ApiError, parse_chat, parse_completion
from edgecore.shared.openai.tools import split_json_calls
from tests.conftest import make_engine
from tests.edge.test_http_hardening import EngineEdge
from tests.edge.tool_template import TIME, WEATHER

pytestmark = pytest.mark.timeout(120)

VOCAB, CTX = 2048, 1024
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def chat(tok, **kw):
    return parse_chat({"messages": USER, **kw}, tok, VOCAB, CTX)


# ---- parsing -------------------------------------------------------------------------------------------------

def test_continuous_usage_is_read_with_include_usage_only(tokenizer):
    both = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert chat(tokenizer, **both).continuous_usage
    assert parse_completion({"prompt": "The", **both}, tokenizer, VOCAB, CTX).continuous_usage
    # as vLLM: without include_usage the option is accepted and does nothing
    alone = chat(tokenizer, stream=True, stream_options={"continuous_usage_stats": True})
    assert not alone.continuous_usage and not alone.include_usage
    assert not chat(tokenizer, stream=True, stream_options={"include_usage": True}).continuous_usage


def test_required_and_named_work_without_a_template_tool_format(tokenizer):
    assert "tool_call" not in (tokenizer.chat_template or "")
    named = chat(tokenizer, tools=[WEATHER, TIME], tool_choice=NAMED)
    assert named.tools.json_calls and named.params[0].guided.kind == "json_schema"
    assert json.loads(named.params[0].guided.value)["properties"] == SCHEMAS["get_weather"]["properties"]
    prompt = tokenizer.decode(named.prompts[0])
    assert prompt.index("You can call this function:") < prompt.index("Weather in Paris?")
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt and "get_time" not in prompt
    required = chat(tokenizer, tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(required.params[0].guided.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    prompt = tokenizer.decode(required.prompts[0])
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt and "JSON array" in prompt
    one = chat(tokenizer, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(one.params[0].guided.value)["maxItems"] == 1
    # an existing system message keeps its text, the preamble follows it
    sys = parse_chat({"messages": [{"role": "system", "content": "Be terse."}, *USER], "tools": [WEATHER],
                      "tool_choice": NAMED}, tokenizer, VOCAB, CTX)
    text = tokenizer.decode(sys.prompts[0])
    assert text.count("<|system|>") == 1 and text.index("Be terse.") < text.index("You can call this function")
    # "auto" still needs a template that writes calls
    with pytest.raises(ApiError) as e:
        chat(tokenizer, tools=[WEATHER], tool_choice="auto")
    assert e.value.param == "tools" and e.value.code == "unsupported_parameter"


def test_parameters_defs_are_lifted_and_bad_schemas_are_400(tokenizer):
    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"], "$defs": defs}}}
    point = {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
    schema = json.loads(chat(tokenizer, tools=[tool("a", point), tool("b", point)],
                             tool_choice="required").params[0].guided.value)
    assert schema["$defs"] == point and all("$defs" not in c["properties"]["parameters"]
                                            for c in schema["items"]["anyOf"])
    named = json.loads(chat(tokenizer, tools=[tool("a", point)], tool_choice={
        "type": "function", "function": {"name": "a"}}).params[0].guided.value)
    assert named["$defs"] == point
    other = {"P": {"type": "string"}}
    with pytest.raises(ApiError) as e:
        chat(tokenizer, tools=[tool("a", point), tool("b", other)], tool_choice="required")
    assert e.value.status == 400 and e.value.param == "tools"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "("}}}}}
    with pytest.raises(ApiError) as e:
        chat(tokenizer, tools=[bad], tool_choice="required")
    assert e.value.status == 400 and e.value.param == "tools"


def test_split_json_calls():
    content, calls = split_json_calls('{"city": "Paris", "unit": "celsius"}', "get_weather")
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    text = '[{"name":"get_time","parameters":{"zone":"UTC"}},{"name":"get_weather","parameters":{"city":"X"'
    content, calls = split_json_calls(text, "required")          # cut by max_tokens: the complete call is kept
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    two = '[{"name":"a","parameters":{}}, {"name":"b","parameters":{"q":1}}]'
    assert [c["function"]["name"] for c in split_json_calls(two, "required")[1]] == ["a", "b"]
    assert [c["function"]["name"] for c in split_json_calls(two, "required", parallel=False)[1]] == ["a"]
    assert split_json_calls('{"city": "Pa', "get_weather") == ('{"city": "Pa', [])
    assert split_json_calls('[{"name": "a", "param', "required") == ('[{"name": "a", "param', [])
    assert split_json_calls("[1, 2]", "required") == ("[1, 2]", [])


# ---- over HTTP, a real engine ------------------------------------------------------------------------------

@pytest.fixture
async def api():
    runner, port = await start_http(EdgeHTTP(EngineEdge(make_engine(num_blocks=128)), "pydoc-llama"),
                                    "127.0.0.1", 0)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=90)) as s:
        yield s
    await runner.cleanup()


async def events(session, path: str, body: dict) -> list[dict]:
    async with session.post(path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    assert text.rstrip().endswith("data: [DONE]")
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


CONTINUOUS = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("chat_api", [True, False])
async def test_every_chunk_carries_the_tokens_so_far(api, tokenizer, chat_api):
    """With logprobs each token is in exactly one chunk, so a chunk's usage is checked against the tokens its
    choice has shown so far; the last chunk is the include_usage total."""
    if chat_api:
        body = {"messages": [{"role": "user", "content": "Explain the for statement."}], "logprobs": True}
        prompt = len(tokenizer.encode_chat(body["messages"]))
    else:
        body = {"prompt": "The module", "logprobs": 0}
        prompt = len(tokenizer.encode("The module"))
    chunks = await events(api, "/v1/chat/completions" if chat_api else "/v1/completions",
                          {**body, "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 3, **CONTINUOUS})
    *token_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 24
    assert final["usage"]["prompt_tokens"] == prompt and final["usage"]["total_tokens"] == prompt + 24
    shown = [0, 0]
    for c in token_chunks:
        (choice,) = c["choices"]
        i = choice["index"]
        lp = choice["logprobs"]
        shown[i] += len(lp["content"] if chat_api else lp["tokens"]) if lp else 0
        assert c["usage"] == {"prompt_tokens": prompt, "completion_tokens": shown[i],
                              "total_tokens": prompt + shown[i]}
    assert shown == [12, 12]
    if chat_api:       # the role chunks come first, with no tokens yet
        assert [c["usage"]["completion_tokens"] for c in token_chunks[:2]] == [0, 0]
    # without continuous_usage_stats only the final chunk has usage (as before)
    plain = await events(api, "/v1/chat/completions" if chat_api else "/v1/completions",
                         {**body, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}})
    assert [("usage" in c) for c in plain] == [False] * (len(plain) - 1) + [True]


def _calls(chunks: list[dict]) -> tuple[list[dict], str | None, str]:
    """(tool calls accumulated from the deltas, finish_reason, content) of one streamed choice."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for c in chunks:
        for choice in c["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] += tc.get("id") or ""
                call["name"] += tc["function"].get("name") or ""
                call["arguments"] += tc["function"].get("arguments") or ""
            reason = choice["finish_reason"] or reason
    return [calls[k] for k in sorted(calls)], reason, content


@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_calls_on_the_bundled_model(api, stream):
    cases = [(NAMED, True, 0.0, 1), ("required", False, 0.0, 1), ("required", False, 1.0, 2), (NAMED, True, 1.0, 3)]
    for choice, parallel, temperature, seed in cases:
        body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel,
                "max_tokens": 120, "temperature": temperature, "seed": seed}
        if stream:
            chunks = await events(api, "/v1/chat/completions", {**body, **CONTINUOUS})
            calls, reason, content = _calls(chunks)
            assert not content and chunks[-1]["usage"]["completion_tokens"] == chunks[-2]["usage"]["completion_tokens"]
        else:
            async with api.post("/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                out = (await resp.json())["choices"][0]
            assert out["message"]["content"] is None
            calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in out["message"]["tool_calls"]]
            reason = out["finish_reason"]
        assert reason == "tool_calls" and len(calls) == 1, (choice, calls)
        if choice is NAMED:
            assert calls[0]["name"] == "get_weather"
        assert calls[0]["id"].startswith("call_")
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


async def test_required_parallel_calls_each_match_their_schema(api):
    """Several calls may come (the bundled model keeps adding them until max_tokens): every complete one is
    returned, each valid."""
    body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 60,
            "temperature": 0}
    async with api.post("/v1/chat/completions", json=body) as resp:
        out = (await resp.json())["choices"][0]
    calls = out["message"]["tool_calls"]
    assert calls and out["finish_reason"] in ("tool_calls", "length")
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
