"""Files that one stage writes and others read (a split's shard manifest, the model description,
the results), as frozen dataclasses: each is read in one place, where every field is checked, so
that a missing or mistyped one fails there in one line naming the file and the key, not as a
KeyError wherever it is first used. Lists are read as tuples; a free-form part (a tokenizer's
description, a config section) is a `dict`. The JSON written is `dataclasses.asdict`'s."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from .errors import OrtflowError

T = TypeVar("T")


class _Wrong(Exception):
    """A field that is missing or of the wrong type; the message names its dotted key."""


def read_json(path: Path, error: type[OrtflowError], remedy: str) -> dict:
    """The JSON object in `path`; `error` naming the file and `remedy` when it is missing or not one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: missing ({remedy})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as problem:
        raise error(f"{path}: not JSON ({problem}); {remedy}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a JSON {type(data).__name__}, not an object; {remedy}")
    return data


def build(cls: type[T], data: dict, path: Path, error: type[OrtflowError], remedy: str) -> T:
    """The record `cls` of `data` (read from `path`), every field checked against its type; keys
    `cls` has no field for are left out. `error` names the file and the key of a missing or mistyped field."""
    try:
        return _value(cls, data, "")
    except _Wrong as wrong:
        raise error(f"{path}: {wrong}; {remedy}") from None


def write(path: Path, record, sort_keys: bool = False) -> None:
    """`record` as indented JSON (its tuples as lists), ending in a newline."""
    write_data(path, dataclasses.asdict(record), sort_keys)


def write_data(path: Path, data: dict, sort_keys: bool = False) -> None:
    """A record's `data` (dataclasses.asdict's, with what its writer leaves out) as `write` writes it."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")


def _value(kind, value, key: str):
    """`value` (at dotted `key`) as `kind`: a dataclass, `tuple[X, ...]`, `X | None`, `dict`, `Any` or a scalar."""
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        return _record(kind, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in arguments:
            return None
        (inner,) = [a for a in arguments if a is not type(None)]
        return _value(inner, value, key)
    if origin is tuple:
        _check(isinstance(value, list), value, key, "a list")
        return tuple(_value(arguments[0], item, f"{key}[{i}]") for i, item in enumerate(value))
    if kind is Any:
        return value
    if kind is dict or origin is dict:
        _check(isinstance(value, dict), value, key, "an object")
    elif kind is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), value, key, "a number")
    elif kind is int:
        _check(isinstance(value, int) and not isinstance(value, bool), value, key, "an integer")
    else:
        _check(isinstance(value, kind), value, key, {str: "a string", bool: "true or false"}[kind])
    return value


def _record(cls, value, key: str):
    _check(isinstance(value, dict), value, key, "an object")
    hints, fields = typing.get_type_hints(cls), {}
    for field in dataclasses.fields(cls):
        dotted = f"{key}.{field.name}".lstrip(".")
        if field.name in value:
            fields[field.name] = _value(hints[field.name], value[field.name], dotted)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise _Wrong(f"no {dotted!r}")
    return cls(**fields)


def _check(holds: bool, value, key: str, expected: str) -> None:
    if not holds:
        raise _Wrong(f"{repr(key) if key else 'the file'} is {json.dumps(value)[:60]}, expected {expected}")
