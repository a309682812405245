"""Chat tools: definitions into the chat template, tool calls out of the model's text.

Life cycle: `parse_chat` calls `tool_set(req, tokenizer)`, which checks
`tools` and `tool_choice` (400s name the field) and picks the parser for the
model's tool-call format (chosen from its chat template: the Hermes
`<tool_call>{json}</tool_call>` form that Qwen2/Qwen3 templates write);
`render_message` turns assistant `tool_calls` (arguments parsed to objects, as
HF templates print them) and `tool` messages into template messages. With
`tool_choice` "required" or a named function, `ToolSet.guided` is a grammar
that admits only well-formed calls (`grammar.py` enforces it): one Hermes call
when the template has that format; otherwise, for any model (as vLLM does),
plain JSON: a named function's arguments object, or for "required" a JSON
array of `{"name", "parameters"}` calls (one when `parallel_tool_calls` is
false), with the tools described in a system message (`ToolSet.preamble`:
each function's JSON schema, one a line, and how to reply) instead of the
template's own tool text. "auto" still needs a template that writes calls.
After generation, `ToolSet.split` turns a choice's text into (content, tool
calls) for the response; while streaming, `ToolSet.stream()` passes content
through, holds back text that may open a call (all of it in the JSON form),
and hands out the calls at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from edgecore.shared.engine import grammar
from edgecore.shared.engine.sampling_params import GuidedSpec
from edgecore.shared.errors import RequestError
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
    guided: GuidedSpec | None         # required / named: the grammar of the calls
    parallel: bool = True             # `parallel_tool_calls`: false keeps the first call of a choice only
    json_calls: bool = False          # no template tool format: calls are plain JSON, tools go in `preamble()`

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, OpenAI `tool_calls`) of a finished choice's text."""
        if self.json_calls:
            return split_json_calls(text, self.choice, self.parallel)
        return split_calls(text, self.parallel)

    def stream(self) -> ToolCallParser:
        """A streamed choice's splitter."""
        return JsonToolCallParser(self) if self.json_calls else ToolCallParser(self.parallel)

    def preamble(self) -> str:
        """The default tool prompt for templates without a tool format: the functions' JSON schemas, one a line,
        and the reply the grammar enforces."""
        functions = [t["function"] for t in self.tools]
        if self.choice != "required":
            fn = next(f for f in functions if f["name"] == self.choice)
            return (f"You can call this function:\n{json.dumps(fn, ensure_ascii=False)}\n"
                    f"Call {fn['name']} now: reply with its arguments alone, as one JSON object that matches its "
                    f"parameters.")
        lines = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        how = "one or more of them" if self.parallel else "exactly one of them"
        return (f"You can call these functions:\n{lines}\nCall {how} now: reply with a JSON array of calls alone, "
                f'each {{"name": <function name>, "parameters": <its arguments as a JSON object>}}.')


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


_DEFS = ("$defs", "definitions")


def _lift_defs(functions: list[dict]) -> tuple[list[dict], dict]:
    """The functions with their parameters' `$defs` / `definitions` (which `#/$defs/...` references name from the
    schema's root) moved out, and those definitions merged, for a schema that nests the parameters: as vLLM does,
    two functions may not define one name differently."""
    lifted: list[dict] = []
    defs: dict[str, dict] = {}
    for f in functions:
        params = dict(f["parameters"])
        for key in _DEFS:
            found = params.pop(key, None)
            if not isinstance(found, dict):
                continue
            for name, schema in found.items():
                if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise _bad(f"the tools define {key} {name!r} differently; give each definition its own name",
                               "tools")
        lifted.append({**f, "parameters": params})
    return lifted, defs


def _grammar(functions: list[dict]) -> GuidedSpec:
    functions, defs = _lift_defs(functions)
    schema: dict = {"anyOf": [_call_schema(f) for f in functions]} if len(functions) > 1 \
        else _call_schema(functions[0])
    schema.update(defs)
    schema["x-guidance"] = {"whitespace_flexible": False}
    lark = f'start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}'
    return GuidedSpec("lark", lark, "tool_choice")


def _json_grammar(functions: list[dict], named: bool, parallel: bool) -> GuidedSpec:
    """The plain-JSON calls (vLLM's forms): a named function's arguments object; for "required" an array of
    {"name", "parameters"} objects, at least one (exactly one unless `parallel`)."""
    if named:
        schema = dict(functions[0]["parameters"])
        schema.setdefault("type", "object")
        return GuidedSpec("json_schema", json.dumps(schema), "tool_choice")
    functions, defs = _lift_defs(functions)
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "items": {"anyOf": calls} if len(calls) > 1 else calls[0], "minItems": 1,
              **({} if parallel else {"maxItems": 1}), **defs}
    return GuidedSpec("json_schema", json.dumps(schema), "tool_choice")


def _checked(spec: GuidedSpec) -> GuidedSpec:
    try:
        grammar.check(spec)
    except RequestError as exc:
        raise _bad(f"the tools' parameters cannot be used as a grammar: {exc}", "tools") from None
    return spec


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
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    hermes = chat_template is not None and OPEN in chat_template
    if choice == "auto" and not hermes:
        raise _bad("this model's chat template has no tool-call format this server can parse "
                   f"(the Hermes '{OPEN}' form); 'tool_choice' 'required' or a named function works with any model",
                   "tools", "unsupported_parameter")
    guided = None
    if choice != "auto":
        chosen = functions if choice == "required" else [f for f in functions if f["name"] == choice]
        guided = _checked(_grammar(chosen) if hermes else _json_grammar(chosen, choice != "required", parallel))
    return ToolSet([{"type": "function", "function": f} for f in functions], choice, guided, parallel,
                   json_calls=not hermes)


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


def _call(name: str, args: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def split_json_calls(text: str, choice: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """The plain-JSON form (`_json_grammar`): (None, the calls) of a named function's arguments object or of a
    "required" array of {"name", "parameters"}; a text that is not such JSON (cut short by `max_tokens`) stays
    content. In a cut array the calls complete before the cut are kept."""
    text_ = text.strip()
    if choice != "required":
        try:
            args = json.loads(text_)
        except json.JSONDecodeError:
            return text, []
        return (None, [_call(choice, args)]) if isinstance(args, dict) else (text, [])
    items: list = []
    try:
        items = json.loads(text_)
    except json.JSONDecodeError:           # cut short: the complete items before the cut
        decoder, at = json.JSONDecoder(), 1
        while text_.startswith("[") and at < len(text_):
            try:
                item, at = decoder.raw_decode(text_, at)
            except json.JSONDecodeError:
                break
            items.append(item)
            at += len(text_[at:]) - len(text_[at:].lstrip(", \n\t"))
    if not isinstance(items, list):
        return text, []
    calls = [_call(item["name"], item.get("parameters", item.get("arguments", {}))) for item in items
             if isinstance(item, dict) and isinstance(item.get("name"), str)]
    if not calls:
        return text, []
    return None, calls if parallel else calls[:1]


class ToolCallParser:
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

    def chunks(self, i: int, new_text: str, finished: bool, finish_reason: str | None, lp: dict | None
               ) -> list[dict]:
        """Choice `i`'s streamed chat deltas for one output: content (text that may open a call held back), and
        at the end one delta per tool call (id, name, the whole arguments) and finish_reason "tool_calls"."""
        text = self.push(new_text)
        calls: list[dict] = []
        if finished:
            tail, calls = self.finish()
            text += tail
        chunks = []
        if text or lp:
            chunks.append({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None})
        for k, call in enumerate(calls):
            chunks.append({"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": None,
                           "finish_reason": None})
        if finished:
            reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
            chunks.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason})
        return chunks


class JsonToolCallParser(ToolCallParser):
    """A streamed choice in the plain-JSON form: the whole text is the call(s), so all of it is held and split
    at the end (content only if it is not such JSON)."""

    def __init__(self, tools: ToolSet):
        super().__init__(tools.parallel)
        self.tools = tools

    def push(self, delta: str) -> str:
        self.held += delta
        return ""

    def finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        content, calls = self.tools.split(held)
        return ("", calls) if calls else (held, [])
