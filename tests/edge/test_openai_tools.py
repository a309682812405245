"""Tools: definitions and tool messages into the template, tool calls parsed from text, streamed, enforced."""

import json

import pytest

from edgecore.shared.openai.request import ApiError, parse_chat
from edgecore.shared.openai.tools import ToolCallParser, split_calls
from edgecore.shared.text.tokenizer import Tokenizer
from tests.edge.tool_template import TIME, WEATHER, tools_model_dir

VOCAB, CTX = 2048, 1024
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_tokenizer(model_dir, tmp_path_factory):
    return Tokenizer.from_dir(tools_model_dir(model_dir, tmp_path_factory.mktemp("m") / "tools-model"))


def chat(tok, **kw):
    return parse_chat({"messages": USER, **kw}, tok, VOCAB, CTX)


def test_tools_reach_the_template_and_choice_sets_the_grammar(tool_tokenizer):
    parsed = chat(tool_tokenizer, tools=[WEATHER, TIME])
    prompt = tool_tokenizer.decode(parsed.prompts[0])
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert parsed.tools.choice == "auto" and parsed.params[0].guided is None
    assert "<tools>" not in tool_tokenizer.decode(chat(tool_tokenizer, tools=[WEATHER], tool_choice="none").prompts[0])
    assert chat(tool_tokenizer, tools=[WEATHER], tool_choice="none").tools is None
    named = chat(tool_tokenizer, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.params[0].guided.kind == "lark" and "get_time" in named.params[0].guided.value
    assert "get_weather" not in named.params[0].guided.value
    assert "anyOf" in chat(tool_tokenizer, tools=[WEATHER, TIME], tool_choice="required").params[0].guided.value


def test_tool_call_and_tool_messages_are_rendered(tool_tokenizer):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    parsed = parse_chat({"messages": messages, "tools": [WEATHER]}, tool_tokenizer, VOCAB, CTX)
    prompt = tool_tokenizer.decode(parsed.prompts[0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
])
def test_bad_tool_fields_are_400_naming_them(tool_tokenizer, kw, param):
    with pytest.raises(ApiError) as e:
        chat(tool_tokenizer, **kw)
    assert e.value.status == 400 and e.value.param == param


def test_a_template_without_a_tool_format_rejects_tools(tokenizer):
    with pytest.raises(ApiError) as e:
        chat(tokenizer, tools=[WEATHER])
    assert e.value.param == "tools" and e.value.code == "unsupported_parameter"
    assert chat(tokenizer, tools=[WEATHER], tool_choice="none").tools is None


def test_split_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, calls = split_calls(text)
    assert content == "Let me check.\n"         # as streamed (and as vLLM's Hermes parser): unstripped
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("a", {"x": 1}),
                                                                                                 ("b", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert split_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert split_calls("plain") == ("plain", [])
    assert [c["function"]["name"] for c in split_calls(text, parallel=False)[1]] == ["a"]
    assert split_calls("\n <tool_call>{\"name\": \"a\"}</tool_call>")[0] is None


def test_parallel_tool_calls_false_keeps_the_first_call(tool_tokenizer):
    assert chat(tool_tokenizer, tools=[WEATHER]).tools.parallel
    assert not chat(tool_tokenizer, tools=[WEATHER], parallel_tool_calls=False).tools.parallel
    stream = ToolCallParser(parallel=False)
    stream.push('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert [c["function"]["name"] for c in stream.finish()[1]] == ["a"]


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_tool_stream_holds_back_only_what_may_open_a_call(cut):
    text = 'Sure <tool <tool_call>{"name": "a", "arguments": {"q": "<"}}</tool_call>'
    stream, shown = ToolCallParser(), ""
    for k in range(0, len(text), cut):
        shown += stream.push(text[k:k + cut])
    tail, calls = stream.finish()
    assert (shown + tail) == "Sure <tool" or (shown + tail).strip() == "Sure <tool"
    assert [c["function"]["name"] for c in calls] == ["a"]
    stream = ToolCallParser()
    assert stream.push("no calls <tool") == "no calls " and stream.finish() == ("<tool", [])
