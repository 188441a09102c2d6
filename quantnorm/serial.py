"""Frozen configuration dataclasses <-> JSON objects (a sweep cell's configuration, sweep.json).

``to_dict`` writes every field (tuples as lists, nested dataclasses as objects); ``from_dict`` is
its exact inverse. It refuses a key the dataclass does not have, because a misspelled or
retired setting would otherwise be dropped silently and the cell would run on a default; and it
checks each value against the field's annotation, so a hand-edited file fails naming the key
instead of deep inside a stage. A key left out takes the field's default (a configuration written
before a field existed still reads). The dataclass's own ``__post_init__`` then validates ranges
and names, as it does for the CLI.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def to_dict(obj: Any) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        out[f.name] = _plain(getattr(obj, f.name))
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def from_dict(cls: type[T], data: Any, what: str) -> T:
    """``cls`` built from ``data`` (as ``to_dict`` writes it); ``what`` names the object in errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} in {what}: the keys are {', '.join(names)}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _value(hints[k], v, f"{what}: {k}") for k, v in data.items()})


def _value(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _value(option, value, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)   # JSON writes 1.0 as 1.0, but a hand-written 1 means the same
        ok = isinstance(value, float)
    elif hint is str:
        ok = isinstance(value, str)
    else:  # a field type this module has no rule for: a programming error, not a user's
        raise TypeError(f"quantnorm.serial cannot read a {hint!r} field ({where})")
    if not ok:
        raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")
    return value


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe(args[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))
