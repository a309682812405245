"""A tool-call round trip with the official `openai` client against a real edge whose template supports tools."""

import json

import jsonschema
import openai
import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.text.tokenizer import Tokenizer
from tests.conftest import make_engine
from tests.e2e.procs import start_edge
from tests.edge.tool_template import TIME, WEATHER, tools_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
USER = {"role": "user", "content": "What is the weather in Paris?"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tools_dir(model_dir, tmp_path_factory):
    return tools_model_dir(model_dir, tmp_path_factory.mktemp("tools") / "tools-model")


@pytest.fixture(scope="module")
def client(tools_dir):
    edge, http = start_edge("--model", str(tools_dir), "--served-model-name", "pydoc-llama")
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=120)
    edge.stop()


def _create(client, messages, stream: bool, **kw):
    """A chat completion, streamed or not, as (content, tool calls as dicts, finish_reason)."""
    kw = {"model": "pydoc-llama", "messages": messages, "max_tokens": 120, "temperature": 0,
          "tools": [WEATHER, TIME], **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:       # accumulate deltas by index, as clients do
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or "" if tc.function else ""
            call["arguments"] += tc.function.arguments or "" if tc.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [calls[k] for k in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip(client, tools_dir, stream):
    content, calls, reason = _create(client, [USER], stream, tool_choice=NAMED)
    assert reason == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_") and not content
    args = json.loads(calls[0]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function", "function": {"name": "get_weather",
                                                               "arguments": calls[0]["arguments"]}}]}
    tool = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "21 degrees and sunny"}
    answer, more, reason = _create(client, [USER, assistant, tool], stream, tool_choice="none")
    assert more == [] and reason in ("stop", "length") and answer
    # The same conversation on a single node: the tool call and the tool's answer reached the template.
    tok = Tokenizer.from_dir(tools_dir)
    rendered = [{"role": "user", "content": USER["content"]},
                {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0]["id"], "type": "function",
                                                                     "function": {"name": "get_weather",
                                                                                  "arguments": args}}]},
                {"role": "tool", "content": tool["content"], "tool_call_id": calls[0]["id"]}]
    ids = tok.encode_chat(rendered)
    assert "<tool_response>\n21 degrees and sunny\n</tool_response>" in tok.decode(ids)
    ref = make_engine(tools_dir).generate([ids], SamplingParams(max_tokens=120, temperature=0))[0]
    assert answer == ref["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_yields_a_valid_call(client, stream):
    for seed, temperature in [(1, 0.0), (2, 1.0), (3, 1.0)]:
        content, calls, reason = _create(client, [USER], stream, tool_choice="required", seed=seed,
                                         temperature=temperature)
        assert reason == "tool_calls" and len(calls) == 1, (content, calls)
        tool = {t["function"]["name"]: t for t in (WEATHER, TIME)}[calls[0]["name"]]
        jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


def test_auto_returns_content_or_calls(client):
    content, calls, reason = _create(client, [USER], False, tool_choice="auto")
    assert (reason == "tool_calls") == bool(calls)
    assert calls or content is not None
