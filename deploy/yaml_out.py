"""A minimal YAML writer for manifests (maps, lists, strings, numbers, booleans, null).

Strings are always double-quoted, escaped to ASCII, which YAML reads verbatim,
so no value can change meaning (`on`, `yes`, `1e3`, `:`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def dump(value: Any, indent: int = 0) -> str:
    return "".join(_lines(value, indent)).rstrip("\n") + "\n"


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    return _quoted(str(value))


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _quoted(text: str) -> str:
    """A YAML double-quoted scalar in ASCII: printable ASCII as is, the rest escaped (`\\uXXXX`, and
    `\\UXXXXXXXX` beyond U+FFFF, where JSON's surrogate pairs are refused by YAML parsers, kustomize's too)."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08X}")
    return '"' + "".join(out) + '"'


def _lines(value: object, indent: int) -> Iterator[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            yield pad + "{}\n"
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                yield f"{pad}{_key(key)}:\n"
                yield from _lines(item, indent + 2)
            else:
                yield f"{pad}{_key(key)}: {_scalar(item) if not isinstance(item, (dict, list)) else ('{}' if isinstance(item, dict) else '[]')}\n"
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)) and item:
                first, *rest = list(_lines(item, indent + 2))
                yield f"{pad}- {first.lstrip()}"
                yield from rest
            else:
                yield f"{pad}- {_scalar(item) if not isinstance(item, (dict, list)) else '{}'}\n"
    else:
        yield pad + _scalar(value) + "\n"


def _key(key: object) -> str:
    text = str(key)
    return text if text.replace("-", "").replace(".", "").replace("/", "").replace("_", "").isalnum() else _scalar(text)
