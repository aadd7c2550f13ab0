"""Files that one stage writes and others read (a split's shard manifest, the model description,
the results), as frozen dataclasses: each is read in one place, where every field is checked, so
that a missing or mistyped one fails there in one line naming the file and the key, not as a
KeyError wherever it is first used. Lists are read as tuples; a free-form part (a tokenizer's
description, a config section) is a `dict`. The JSON written is `dataclasses.asdict`'s (less what a
writer leaves out), whole or not at all (atomic.py)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

from . import atomic
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


def read(cls: type[T], path: Path, error: type[OrtflowError], remedy: str, missing: OrtflowError | None = None,
         check: Callable[[dict], None] | None = None) -> T:
    """The record `cls` of the JSON file `path` (read_json, then build). `missing`: what to raise
    when there is no file (else `error` says it is missing); `check(data)`: a look at the JSON
    before its fields are (a format's name, which explains a file better than its first odd key)."""
    if missing is not None and not Path(path).is_file():
        raise missing
    data = read_json(path, error, remedy)
    if check is not None:
        check(data)
    return build(cls, data, path, error, remedy)


def build(cls: type[T], data: dict, path: Path, error: type[OrtflowError], remedy: str) -> T:
    """The record `cls` of `data` (read from `path`), every field checked against its type; keys
    `cls` has no field for are left out. `error` names the file and the key of a missing or mistyped field."""
    try:
        return _value(cls, data, "")
    except _Wrong as wrong:
        raise error(f"{path}: {wrong}; {remedy}") from None


def write(path: Path, record, end: str = "\n", sync: bool = True, **dumps) -> None:
    """`record` as JSON (its tuples as lists), as `write_data` writes it."""
    write_data(path, dataclasses.asdict(record), end, sync, **dumps)


def write_data(path: Path, data: dict, end: str = "\n", sync: bool = True, **dumps) -> None:
    """A record's `data` (dataclasses.asdict's, less what its writer leaves out) to `path` whole or not at
    all: json.dumps' text with its options `dumps` (indented by 2 unless told), then `end`. `sync=False`
    for a file that matters only while its writer lives (atomic.write_bytes)."""
    atomic.write_text(path, json.dumps(data, **{"indent": 2, **dumps}) + end, sync)


def _value(kind, value, key: str):
    """`value` (at dotted `key`) as `kind`: a dataclass, `tuple[X, ...]`, `X | None`, `dict`, `Any` or a scalar."""
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        return _record(kind, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in arguments:
            return None
        alternatives = [a for a in arguments if a is not type(None)]
        if len(alternatives) == 1:
            return _value(alternatives[0], value, key)
        for alternative in alternatives:  # scalars (a dim: a number, or a symbol's name)
            if _fits(alternative, value):
                return value
        _check(False, value, key, " or ".join(_NAMES[a] for a in alternatives))
    if origin is tuple:
        _check(isinstance(value, list), value, key, "a list")
        return tuple(_value(arguments[0], item, f"{key}[{i}]") for i, item in enumerate(value))
    if kind is Any:
        return value
    _check(_fits(kind, value), value, key, _NAMES[dict if origin is dict else kind])
    return value


_NAMES = {dict: "an object", float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def _fits(kind, value) -> bool:
    """Whether `value` is of the scalar `kind` (or `dict`): a bool is no number, an integer is a float."""
    if kind is dict or typing.get_origin(kind) is dict:
        return isinstance(value, dict)
    if kind in (int, float):
        return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    return isinstance(value, kind)


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
