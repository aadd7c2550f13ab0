"""The typed config of a validated one, and back: after `validate`, code reads the config as
frozen dataclasses, one per section of the schema (`config.train.optimizer.lr`), generated from
the schema into sections.py. A list becomes a tuple and a free-form mapping (model.kwargs,
sweep.grid) a read-only one; `as_dict` gives plain JSON-able data again."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from .schema import read_schema
from .sections import SECTIONS, Config


def _frozen(value: Any, schema: dict, path: str) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        return SECTIONS[path](**{key: _frozen(value[key], sub, f"{path}.{key}".lstrip("."))
                                 for key, sub in schema["properties"].items()})
    if isinstance(value, dict):
        return types.MappingProxyType({key: _frozen(item, {}, "") for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(item, schema.get("items", {}), "") for item in value)
    return value


def typed(validated: dict) -> Config:
    """The typed config of a config that `validate` returned (every key filled in)."""
    return _frozen(validated, read_schema(), "")


def as_dict(value: Any) -> Any:
    """A typed config, or a section or value of one, as plain JSON-able data again."""
    if dataclasses.is_dataclass(value):
        return {field.name: as_dict(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (dict, types.MappingProxyType)):
        return {key: as_dict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_dict(item) for item in value]
    return value

