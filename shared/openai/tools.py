"""Chat tools: definitions into the chat template, tool calls out of the model's text.

Life cycle: `parse_chat` calls `tool_set(req, tokenizer)`, which checks
`tools` and `tool_choice` (400s name the field) and picks the parser for the
model's tool-call format (chosen from its chat template: the Hermes
`<tool_call>{json}</tool_call>` form that Qwen2/Qwen3 templates write);
`render_message` turns assistant `tool_calls` (arguments parsed to objects, as
HF templates print them) and `tool` messages into template messages. With
`tool_choice` "required" or a named function, `ToolSet.guided` is a grammar
that admits exactly one well-formed call (`grammar.py` enforces it). After
generation, `split_calls` turns a choice's text into (content, tool calls)
for the response; while streaming, `ToolStream` passes content through,
holds back text that may open a call, and hands out the calls at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from edgecore.shared.engine.sampling_params import GuidedSpec
from edgecore.shared.openai.errors import ApiError
from edgecore.shared.openai.schemas import ChatRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.S)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class ToolSet:
    tools: list[dict]                 # as the chat template takes them ({"type": "function", "function": {...}})
    choice: str                       # "auto", "required", or a function's name
    guided: GuidedSpec | None         # required / named: the one-call grammar
    parallel: bool = True             # `parallel_tool_calls`: false keeps the first call of a choice only


def _function(tool: Any, i: int) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(f"'{param}' must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise _bad(f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-'", f"{param}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise _bad(f"'{param}.function.parameters' must be a JSON schema object", f"{param}.function.parameters")
    out = {"name": fn["name"], "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return out


def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def _grammar(functions: list[dict]) -> GuidedSpec:
    schema: dict = {"anyOf": [_call_schema(f) for f in functions]} if len(functions) > 1 \
        else _call_schema(functions[0])
    schema["x-guidance"] = {"whitespace_flexible": False}
    lark = f'start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}'
    return GuidedSpec("lark", lark, "tool_choice")


def _choice(value: Any, names: list[str]) -> str:
    if value is None or value in ("auto", "none", "required"):
        return value or "auto"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name in names:
            return name
        raise _bad(f"'tool_choice' names function {name!r}, which is not among 'tools'", "tool_choice")
    raise _bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
               "{\"name\": ...}}", "tool_choice")


def tool_set(req: ChatRequest, chat_template: str | None) -> ToolSet | None:
    """The request's tools, checked; None when the model is to see no tools."""
    tools = req.tools or []
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools", "invalid_type")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    choice = _choice(req.tool_choice, [f["name"] for f in functions])
    if not functions:
        if choice not in ("auto", "none"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if choice == "none":
        return None
    if not chat_template or OPEN not in chat_template:
        raise _bad("this model's chat template has no tool-call format this server can parse "
                   f"(the Hermes '{OPEN}' form)", "tools", "unsupported_parameter")
    guided = None
    if choice != "auto":
        chosen = functions if choice == "required" else [f for f in functions if f["name"] == choice]
        guided = _grammar(chosen)
    parallel = getattr(req, "parallel_tool_calls", None)
    return ToolSet([{"type": "function", "function": f} for f in functions], choice, guided, parallel is not False)


def _arguments(text: Any, param: str) -> Any:
    if isinstance(text, dict):
        return text
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError):
        raise _bad(f"'{param}' must be a JSON object (as a string)", param) from None


def render_tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's `tool_calls` as the chat template takes them (arguments as objects)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(f"'{param}' must be a list", param, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"'{param}[{j}]' must have a 'function' with a 'name'", f"{param}[{j}]")
        args = _arguments(fn.get("arguments", "{}"), f"{param}[{j}].function.arguments")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def split_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content before the first call, or None if blank; the OpenAI `tool_calls`: the first only unless
    `parallel`) of a generated text. A `<tool_call>` whose body is not a {"name", "arguments"} object stays
    content."""
    calls, first = [], None
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        first = match.start() if first is None else first
        args = body.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = text[:first]          # as streamed: the text before the first call, unstripped
    return (content if content.strip() else None), (calls if parallel else calls[:1])


class ToolStream:
    """One streamed choice: content deltas pass through until text that may open a call; the rest is held
    and split into calls when the choice finishes."""

    def __init__(self, parallel: bool = True):
        self.held = ""
        self.calling = False
        self.parallel = parallel

    def push(self, delta: str) -> str:
        """The part of `delta` that can be shown as content now."""
        if self.calling:
            self.held += delta
            return ""
        text = self.held + delta
        at = text.find(OPEN)
        if at >= 0:
            self.calling, self.held = True, text[at:]
            return text[:at]
        keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to show, tool calls) at the end of the choice."""
        held, self.held = self.held, ""
        content, calls = split_calls(held, self.parallel)
        if not calls:
            return held, []
        return content or "", calls
