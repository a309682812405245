"""msgspec validation errors turned into (key path, plain message) for file formats.

Life cycle: `explain(error, raw, root)` parses the path msgspec reports
(`$.regions[...][0].tp`, `key` in `$.regions`), fills in the dict keys
msgspec leaves out (`[...]`: the first entry that fails on its own), walks
the declared types alongside, and rewrites the message in the file's words:
"must be int >= 1, got 0", "is not a known key (expected a, b)", "must be
'cpu' or 'cuda', got 'tpu'". The caller maps the path to a line.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import msgspec

Path = tuple[str | int, ...]
WILD = object()          # a dict key msgspec did not name
_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|(\[\.\.\.\])|\['((?:[^'\\]|\\.)*)'\]")
_AT = re.compile(r"^(?P<msg>.*?) - at `(?P<where>[^`]*)`(?: in `(?P<within>[^`]*)`)?$", re.S)


def _strip(tp: Any) -> Any:
    """Annotated[X, Meta] -> X; Optional[X] -> X."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _fields(struct: type) -> dict[str, Any]:
    """Encoded field name -> declared type of a Struct."""
    hints = typing.get_type_hints(struct, include_extras=True)
    return {f.encode_name: hints[f.name] for f in msgspec.structs.fields(struct)}


def _child(tp: Any, step: str | int | object) -> tuple[Any, Any]:
    """(type of the key, type of the value) one step below `tp`."""
    tp = _strip(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return str, _fields(tp).get(step, Any) if isinstance(step, str) else Any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict:
        return args[0], args[1]
    if origin in (list, tuple) and args:
        return int, args[0]
    return Any, Any


def _fails(value: Any, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError:
        return True
    return False


def _parse(where: str) -> list[Any]:
    steps: list[Any] = []
    for name, index, wild, quoted in _TOKEN.findall(where.removeprefix("$")):
        steps.append(name or (int(index) if index else (WILD if wild else quoted)))
    return steps


def _resolve(steps: list[Any], raw: Any, root: Any) -> tuple[Path, Any, Any]:
    """Fill in WILD keys; return the path, the raw value there and its declared type."""
    path: list[str | int] = []
    value, tp = raw, root
    for step in steps:
        key_tp, value_tp = _child(tp, step)
        if step is WILD and isinstance(value, dict):
            step = next((k for k, v in value.items() if _fails(v, value_tp)), "?")
        path.append(step)
        value = value.get(step) if isinstance(value, dict) else (
            value[step] if isinstance(value, list) and isinstance(step, int) and step < len(value) else None)
        tp = value_tp
    return tuple(path), value, tp


def _literal_choices(tp: Any) -> list[Any] | None:
    tp = _strip(tp)
    return list(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else None


def explain(error: msgspec.ValidationError, raw: Any, root: Any, names: dict[str, str] | None = None
            ) -> tuple[Path, str]:
    """`names` maps a regex pattern to the words shown for it ("a valid name (lowercase letters ...)")."""
    text = str(error)
    match = _AT.match(text)
    message, where = (match["msg"], match["where"]) if match else (text, "$")
    if match and match["within"]:                           # a dict key failed
        path, value, tp = _resolve(_parse(match["within"]), raw, root)
        key_tp = _child(tp, WILD)[0]
        bad = next((k for k in (value or {}) if _fails(k, key_tp)), "?")
        return path + (bad,), _rewrite(message, bad, key_tp, names)
    path, value, tp = _resolve(_parse(where), raw, root)
    unknown = re.match(r"Object contains unknown field `(.+)`", message)
    if unknown:
        expected = ", ".join(sorted(_fields(_strip(tp)))) if _is_struct(tp) else ""
        return path + (unknown[1],), "is not a known key" + (f" (expected {expected})" if expected else "")
    missing = re.match(r"Object missing required field `(.+)`", message)
    if missing:
        return path + (missing[1],), "is required"
    return path, _rewrite(message, value, tp, names)


def _is_struct(tp: Any) -> bool:
    tp = _strip(tp)
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _rewrite(message: str, value: Any, tp: Any, names: dict[str, str] | None) -> str:
    choices = _literal_choices(tp)
    if message.startswith("Invalid enum value") and choices:
        shown = " or ".join(", ".join(repr(c) for c in choices).rsplit(", ", 1))
        return f"must be {shown}, got {value!r}"
    regex = re.match(r"Expected `str` matching regex '(.*)'$", message)
    if regex:
        pattern = regex[1].replace("\\\\", "\\")        # msgspec shows the pattern's backslashes doubled
        words = (names or {}).get(pattern, f"a string matching {pattern}")
        return f"is not {words}: {value!r}"
    length = re.match(r"Expected `(object|array)` of length >= (\d+)$", message)
    if length:
        return f"must have at least {length[2]} {'entry' if length[2] == '1' else 'entries'}"
    expected = re.match(r"Expected (.+?)(?:, got `(.+)`)?$", message)
    if expected:
        want = expected[1].replace("`", "")
        return f"must be {want}, got {value!r}"
    return message
