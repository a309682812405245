"""Settings defined once: typed dataclass fields that carry their command-line flag and help.

Life cycle: a node's settings class (`edge/settings.py`, `core/settings.py`) declares each setting once, as a
field made with `setting(default, help=...)`; its flag is `--` and the field's name with `-` for `_`, its type
the field's annotation (`int`, `float`, `str`, a `Literal` of choices, `bool`: a switch, `tuple[str, ...]`: a
repeatable flag; `| None` where unset means "not given"). `add_arguments(parser, cls)` adds the flags to an
argparse parser; `from_args(cls, namespace)` builds the settings object from what argparse parsed; the node
builds its runtime config from that object; `to_argv(settings)` renders an object as the flags that parse
back to it (defaults left out), for whatever starts a node: `edgecore up`, the Kubernetes manifests, the
edge's engine process.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_KEY = "edgecore.setting"
_SCALARS: dict[type, Callable[[str], Any]] = {str: str, int: int, float: float}


@dataclasses.dataclass(frozen=True)
class Flag:
    """What a setting's field says about its flag (the rest comes from its name, type and default)."""
    help: str | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()     # older flag names that still parse (rendered argv uses the field's own)


@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str
    flag: str
    kind: type                        # str, int, float or bool (of one item, for a repeatable flag)
    choices: tuple[str, ...] | None
    repeated: bool
    default: Any
    meta: Flag


def setting(default: Any = dataclasses.MISSING, *, help: str | None = None, metavar: str | None = None,
            aliases: tuple[str, ...] = ()) -> Any:
    """A settings field: its default, the help and metavar its flag shows, and older names of its flag."""
    return dataclasses.field(default=default, metadata={_KEY: Flag(help, metavar, aliases)})


def _spec(field: dataclasses.Field, hint: Any) -> _Spec:
    flag = "--" + field.name.replace("_", "-")
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        items = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(items) != 1:
            raise TypeError(f"{flag}: one type besides None, not {hint}")
        hint = items[0]
    repeated = typing.get_origin(hint) is tuple
    if repeated:
        if typing.get_args(hint)[1:] != (Ellipsis,):
            raise TypeError(f"{flag}: a repeatable setting is tuple[X, ...], not {hint}")
        hint = typing.get_args(hint)[0]
    choices = None
    if typing.get_origin(hint) is typing.Literal:
        choices, hint = tuple(typing.get_args(hint)), str
    if hint is not bool and hint not in _SCALARS:
        raise TypeError(f"{flag}: settings are str, int, float, bool, Literal or tuples of them, not {hint}")
    if hint is bool and (repeated or field.default is not False):
        raise TypeError(f"{flag}: a switch is a bool that defaults to False")
    if repeated and field.default not in ((), None):
        raise TypeError(f"{flag}: a repeatable setting defaults to () or None")   # argparse appends to a default
    return _Spec(field.name, flag, hint, choices, repeated, field.default, field.metadata.get(_KEY, Flag()))


def specs(cls: type) -> list[_Spec]:
    """The settings of a settings class, in field order (the order of its flags in --help)."""
    hints = typing.get_type_hints(cls)
    return [_spec(f, hints[f.name]) for f in dataclasses.fields(cls)]


def flag_names(cls: type) -> dict[str, str]:
    """Each flag of a settings class → its field's name."""
    return {s.flag: s.name for s in specs(cls)}


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argparse flag per field, in field order."""
    for s in specs(cls):
        kwargs: dict[str, Any] = {"default": [] if s.repeated and s.default == () else s.default,
                                  "help": s.meta.help}
        if s.kind is bool:
            kwargs["action"] = "store_true"
        else:
            if s.repeated:
                kwargs["action"] = "append"
            if s.kind is not str:
                kwargs["type"] = _SCALARS[s.kind]
            if s.meta.metavar is not None:
                kwargs["metavar"] = s.meta.metavar
            if s.choices is not None:
                kwargs["choices"] = list(s.choices)
        parser.add_argument(s.flag, *s.meta.aliases, dest=s.name, **kwargs)


def from_args(cls: type[T], namespace: argparse.Namespace) -> T:
    """The settings object of what argparse parsed (repeated flags as tuples)."""
    values = {}
    for s in specs(cls):
        value = getattr(namespace, s.name)
        values[s.name] = tuple(value) if s.repeated and value is not None else value
    return cls(**values)


def to_argv(settings: object) -> list[str]:
    """The flags that parse back to `settings`: every value that is not its default, in field order."""
    argv: list[str] = []
    for s in specs(type(settings)):
        value = getattr(settings, s.name)
        if value == s.default:
            continue
        if s.kind is bool:
            argv.append(s.flag)
        elif value is None or (s.repeated and not value):
            raise ValueError(f"{s.flag}: {value!r} cannot be given as a flag (its default is {s.default!r})")
        else:
            for item in value if s.repeated else (value,):
                text = str(item)
                argv += [f"{s.flag}={text}"] if text.startswith("-") else [s.flag, text]
    return argv


def namespace(settings: object) -> argparse.Namespace:
    """The settings as an argparse namespace, for helpers that read one (`shared/node/cli.py`, `shared/node/http_server.py`)."""
    return argparse.Namespace(**{s.name: getattr(settings, s.name) for s in specs(type(settings))})
