"""What benchmark and agent clients send, against a real edge serving the bundled model (whose chat template
has no tool format): vLLM's continuous usage stats as guidellm asks for them, langchain-openai's tool and
structured-output modes, and instructor's modes (tools with a named function, JSON schema) as the `openai`
client sends them. No request may fail.

instructor itself is not installed (every release pins `jiter<0.15`, which the pinned `openai` cannot use)
and neither is guidellm (about 330 MB more: pandas, pyarrow, datasets); `GUIDELLM=/path/to/guidellm` runs a
short guidellm benchmark here too."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.procs import ROOT, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
MODEL = "pydoc-llama"
ASK = "What is the weather in Paris?"


class Weather(BaseModel):
    """Current weather in a city"""
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def edge_port():
    edge, http = start_edge()
    yield http
    edge.stop()


@pytest.fixture(scope="module")
def client(edge_port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{edge_port}/v1", api_key="unused", max_retries=0, timeout=60)


def test_guidellm_stream_options(client):
    """guidellm's request: include_usage and continuous_usage_stats; it reads the usage of every chunk."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for kind in ("chat", "completions"):
        if kind == "chat":
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=8, stream=True, stream_options=opts)
        else:
            stream = client.completions.create(model=MODEL, prompt="The module", max_tokens=8, stream=True,
                                               stream_options=opts)
        chunks = list(stream)
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
        assert chunks[-1].choices == [] and counts[-1] == counts[-2] == 8
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 8


@pytest.mark.skipif(not os.environ.get("GUIDELLM"), reason="GUIDELLM (a guidellm command) not given")
def test_guidellm_benchmark(edge_port, tmp_path):
    out = tmp_path / "out.json"
    for fmt in ("/v1/chat/completions", "/v1/completions"):
        # run beside the model's folder: guidellm loads the tokenizer named like the served model
        subprocess.run([os.environ["GUIDELLM"], "run", "--backend",
                        f"kind=openai_http,target=http://127.0.0.1:{edge_port},request_format={fmt}",
                        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=5",
                        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
                        "--output", f"kind=json,path={out}", "--disable-console"],
                       cwd=ROOT / "models", env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True, timeout=100,
                       capture_output=True)
        state = json.loads(out.read_text())["benchmarks"][0]["scheduler_state"]
        assert (state["successful_requests"], state["errored_requests"]) == (5, 0), state


def test_instructor_modes(client):
    """instructor's TOOLS mode (a named function) and JSON_SCHEMA mode, as it sends them; and the `openai`
    client's own `parse` helpers (strict tools, a pydantic response_format)."""
    messages = [{"role": "user", "content": ASK}]
    tool = {"type": "function", "function": {"name": "Weather", "description": Weather.__doc__,
                                             "parameters": Weather.model_json_schema()}}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool], max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "Weather"}})
    assert r.choices[0].finish_reason == "tool_calls"
    Weather.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, response_format={
        "type": "json_schema", "json_schema": {"name": "Weather", "schema": Weather.model_json_schema()}})
    Weather.model_validate_json(r.choices[0].message.content)
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=120, temperature=0,
                                           tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
                                           parallel_tool_calls=False)
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, Weather)
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=120, response_format=Weather)
    assert isinstance(parsed.choices[0].message.parsed, Weather)


def test_langchain_openai_modes(edge_port):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"http://127.0.0.1:{edge_port}/v1", api_key="unused", model=MODEL,
                                      temperature=0, max_tokens=120, max_retries=0, timeout=60)
    for choice in ("Weather", "any"):            # a named tool; "any" (sent as "required")
        msg = llm.bind_tools([Weather], tool_choice=choice, parallel_tool_calls=False).invoke(ASK)
        assert [c["name"] for c in msg.tool_calls] == ["Weather"] and not msg.invalid_tool_calls
        Weather.model_validate(msg.tool_calls[0]["args"])
    merged = None
    for chunk in llm.bind_tools([Weather], tool_choice="Weather").stream(ASK):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["Weather"]
    Weather.model_validate(merged.tool_calls[0]["args"])
    for method in ("function_calling", "json_schema"):
        assert isinstance(llm.with_structured_output(Weather, method=method).invoke(ASK), Weather)
    # JSON mode: any JSON object (the bundled model fills no schema it is not given)
    assert isinstance(json.loads(llm.bind(response_format={"type": "json_object"}).invoke(ASK).content), dict)
