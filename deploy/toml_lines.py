"""Line numbers of keys in a TOML text (tomllib gives values, not positions).

Life cycle: `TomlLines(text)` scans the text once, following table headers
(`[a.b]`, `[[a.b]]` with their running index) and `key = value` lines (dotted
keys too), and records the line of every key path; `line(path)` then answers
the line of a path such as `("regions", "east", "cores", 0, "tp")`, or of its
longest recorded prefix when the key itself is absent (the table it belongs in).
Inline tables and multi-line values count as the line of their key.
"""

from __future__ import annotations

import re

_BARE = r"[A-Za-z0-9_-]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"|\'[^\']*\''
_KEY = rf"(?:{_BARE}|{_QUOTED})(?:\s*\.\s*(?:{_BARE}|{_QUOTED}))*"
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_KEY})\s*\]\]?\s*(#.*)?$")
_ASSIGN = re.compile(rf"^\s*({_KEY})\s*=")
_PART = re.compile(rf"{_BARE}|{_QUOTED}")

Path = tuple[str | int, ...]


def _parts(key: str) -> tuple[str, ...]:
    return tuple(p[1:-1] if p[0] in "\"'" else p for p in _PART.findall(key))


class TomlLines:
    def __init__(self, text: str):
        self.lines: dict[Path, int] = {}
        arrays: dict[tuple[str, ...], int] = {}      # array-of-tables path -> index of its last element
        table: Path = ()
        in_multiline = False
        for number, line in enumerate(text.splitlines(), start=1):
            if line.count('"""') % 2 or line.count("'''") % 2:
                was, in_multiline = in_multiline, not in_multiline
                if was:
                    continue
            elif in_multiline:
                continue
            header = _HEADER.match(line)
            if header:
                names = _parts(header.group(2))
                if header.group(1) == "[[":
                    arrays[names] = arrays.get(names, -1) + 1
                table = self._expand(names, arrays)
                self.lines.setdefault(table, number)
                continue
            assign = _ASSIGN.match(line)
            if assign:
                self.lines.setdefault(table + _parts(assign.group(1)), number)

    @staticmethod
    def _expand(names: tuple[str, ...], arrays: dict[tuple[str, ...], int]) -> Path:
        """`regions.east.cores.resources` -> ("regions", "east", "cores", 2, "resources") when
        `regions.east.cores` is an array of tables whose last element is index 2."""
        path: list[str | int] = []
        for i, name in enumerate(names):
            path.append(name)
            if names[: i + 1] in arrays:
                path.append(arrays[names[: i + 1]])
        return tuple(path)

    def line(self, path: Path) -> int:
        for end in range(len(path), 0, -1):
            if path[:end] in self.lines:
                return self.lines[path[:end]]
        return 1
