"""Writes sections.py, the typed config's frozen dataclasses, from config.schema.yaml:
`python -m ortflow.config.generate` after each change of the schema. The schema stays the one
source of the keys; tests/test_config.py fails while sections.py is not what it gives."""

from __future__ import annotations

import json
from pathlib import Path

from .schema import read_schema

SECTIONS_FILE = Path(__file__).with_name("sections.py")
COMMAND = "python -m ortflow.config.generate"
SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool"}
HEADER = f'''"""The validated run configuration, one frozen dataclass a section of config.schema.yaml, with
the schema's types: a misspelled key fails in a type checker, and at run time when read.

Written by `{COMMAND}` from the schema: edit the schema, then run it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
'''


def class_name(path: str) -> str:
    """`LrSchedule` for train.lr_schedule: a section by its own name, `Config` for the whole."""
    return "".join(word.title() for word in path.split(".")[-1].split("_")) or "Config"


def annotation(node: dict, path: str, classes: dict[str, tuple[str, str]]) -> str:
    """The type of the values that the schema's `node` (at dotted `path`) allows, after `typed`:
    a section its class (written into `classes`), a list a tuple, a free-form mapping a Mapping."""
    if "enum" in node:
        return f"Literal[{', '.join(json.dumps(value) for value in node['enum'])}]"
    kinds = node.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    types = []
    for kind in (kind for kind in kinds if kind != "null"):
        if kind == "object" and "properties" in node:
            types.append(section(node, path, classes))
        elif kind == "object":
            types.append("Mapping[str, Any]")
        elif kind == "array":
            item = annotation(node["items"], path, classes) if "items" in node else "Any"
            fixed = node.get("minItems") == node.get("maxItems") is not None  # [first, last], betas
            types.append(f"tuple[{', '.join([item] * node['maxItems']) if fixed else item + ', ...'}]")
        else:
            types.append(SCALARS[kind])
    return " | ".join(types + ["None"] * ("null" in kinds)) or "Any"


def section(node: dict, path: str, classes: dict[str, tuple[str, str]]) -> str:
    """Put the section at `path` into `classes` (name -> its path and its class's text), after its own
    sections; return its name."""
    name = class_name(path)
    fields = [f"    {key}: {annotation(sub, f'{path}.{key}'.lstrip('.'), classes)}\n"
              for key, sub in node["properties"].items()]
    if name in classes:  # two sections of one name would be one class
        raise ValueError(f"config.schema.yaml: sections {classes[name][0]!r} and {path!r} are both {name}")
    where = f"config section '{path}'" if path else "The whole config"
    classes[name] = (path, f"\n\n@dataclass(frozen=True, slots=True)\nclass {name}:\n"
                           f'    """{where} (config.schema.yaml)."""\n\n' + "".join(fields))
    return name


def source() -> str:
    """The text of sections.py for the schema as it is now."""
    classes: dict[str, tuple[str, str]] = {}
    section(read_schema(), "", classes)
    table = "".join(f"    {json.dumps(path)}: {name},\n" for name, (path, _) in classes.items())
    return (HEADER + "".join(text for _, text in classes.values())
            + "\n\n# Each section's class by its dotted path (\"\" for the whole config), for `typed`.\n"
            + f"SECTIONS: dict[str, type] = {{\n{table}}}\n")


def main() -> None:
    SECTIONS_FILE.write_text(source())
    print(f"wrote {SECTIONS_FILE}")


if __name__ == "__main__":
    main()
