"""Structured-output request fields → one `GuidedSpec` (or none).

Life cycle: `request.py` calls `guided_spec(req)` after the body has been
decoded. OpenAI's `response_format` (`text`, `json_object`, `json_schema`
with its `schema`), vLLM's extras (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` in Lark syntax) and its newer
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
`json_object`) are read here; at most one constraint may be given. The
grammar is checked at once (`grammar.check`), so a bad schema or regex is a
400 naming the field, never a failure inside the engine.
"""

from __future__ import annotations

import json
from typing import Any

from edgecore.shared.engine import grammar
from edgecore.shared.engine.sampling_params import GuidedSpec
from edgecore.shared.errors import RequestError
from edgecore.shared.openai.errors import ApiError
from edgecore.shared.openai.schemas import SamplingFields

_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _bad(f"'{param}' is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be a JSON schema (an object)", param)
    return json.dumps(value)


def _response_format(value: Any) -> GuidedSpec | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", "", param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _bad("'response_format.json_schema' must be an object with a 'schema'",
                       "response_format.json_schema")
        return GuidedSpec("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema"),
                          "response_format.json_schema.schema")
    raise _bad(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
               "response_format.type")


def _extra(name: str, value: Any, param: str | None = None) -> GuidedSpec:
    """A vLLM extra (`name`), given as `param` (itself, or a key of `structured_outputs`)."""
    param = param or name
    if name == "guided_json":
        return GuidedSpec("json_schema", _schema_text(value, param), param)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(f"'{param}' must be a non-empty list of non-empty strings", param)
        return GuidedSpec("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise _bad(f"'{param}' must be a non-empty string", param)
    return GuidedSpec("regex" if name == "guided_regex" else "lark", value, param)


def _structured_outputs(value: Any) -> list[GuidedSpec]:
    """vLLM's `structured_outputs` object (its newer form of the extras): the constraints it sets; a key this
    server does not implement (`structural_tag`, whitespace options, ...) is a 400 naming it."""
    if not isinstance(value, dict):
        raise _bad("'structured_outputs' must be an object", "structured_outputs")
    specs = []
    for key, v in value.items():
        param = f"structured_outputs.{key}"
        if v is None or v is False:           # unset, as vLLM's defaults
            continue
        if key in _STRUCTURED:
            specs.append(_extra(_STRUCTURED[key], v, param))
        elif key == "json_object" and v is True:
            specs.append(GuidedSpec("json_object", "", param))
        else:
            raise ApiError(400, f"'{param}' is not supported by this server", param, "unsupported_parameter")
    return specs


def guided_spec(req: SamplingFields) -> GuidedSpec | None:
    """The request's grammar, checked; None when it asks for none."""
    specs = [_extra(name, getattr(req, name)) for name in _EXTRAS if getattr(req, name, None) is not None]
    if req.response_format is not None:
        fmt = _response_format(req.response_format)
        if fmt is not None:                             # response_format "text": no constraint
            specs.append(fmt)
    if getattr(req, "structured_outputs", None) is not None:
        specs += _structured_outputs(req.structured_outputs)
    if len(specs) > 1:
        names = [s.param.split(".json_schema")[0] for s in specs]
        raise _bad(f"at most one of {', '.join(names)} may be given", names[-1])
    spec = specs[0] if specs else None
    if spec is not None:
        try:
            grammar.check(spec)
        except RequestError as exc:
            raise _bad(str(exc), spec.param) from None
    return spec
