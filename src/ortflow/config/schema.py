"""The schema: config.schema.yaml read once a process, a config checked against it with every
default filled in, and its values read as their writer meant them (`1e-3` a number, Snakemake's
--config values typed); dotted keys (`train.optimizer.lr`) nested into their sections."""

from __future__ import annotations

import copy
import functools
import math
import re
from importlib import resources
from typing import Any

import jsonschema
import yaml

from ..errors import ConfigError

# Every key, its default and its allowed values: package data of ortflow (pyproject.toml's
# package-data), so that the workflow and an installed ortflow read the same file.
SCHEMA = "config.schema.yaml"


def schema_file():
    """The schema file, found through importlib.resources, wherever ortflow is installed
    (beside this package, in ortflow's own folder)."""
    return resources.files("ortflow") / SCHEMA


@functools.cache
def read_schema() -> dict:
    """The schema, read once a process: a sweep validates every point's config, and reads
    every swept value, through it. Nothing changes it (defaults are copied out of it)."""
    return yaml.safe_load(schema_file().read_text())


def _with_defaults(validator_class):
    """A validator that fills in each property's `default` before checking it,
    so that nested sections get their defaults too; whose `pattern` must match
    the whole string (JSON schema's is a search, and Python's `$` also matches
    before a trailing newline: "x\n" would pass `^[a-z]+$`); and for which a
    number is finite (YAML's `.nan` and `.inf` are floats)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    def full_match(validator, pattern, instance, schema):
        if isinstance(instance, str) and not re.fullmatch(pattern, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")

    def finite_number(checker, instance) -> bool:
        return jsonschema.Draft202012Validator.TYPE_CHECKER.is_type(instance, "number") and math.isfinite(instance)

    type_checker = validator_class.TYPE_CHECKER.redefine("number", finite_number)
    return jsonschema.validators.extend(validator_class, {"properties": set_defaults, "pattern": full_match},
                                        type_checker=type_checker)


def expand_dotted(config: dict) -> dict:
    """`--config train.world_size=1` arrives as the key "train.world_size";
    nest such keys so that they override the section they name."""
    out: dict = {}
    for key, value in config.items():
        if isinstance(value, dict) and key in out and isinstance(out[key], dict):
            out[key] = merge(out[key], value)
            continue
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{part}' is not a section")
        node[parts[-1]] = merge(node.get(parts[-1]), value) if isinstance(value, dict) else value
    return out


def merge(base: Any, override: dict) -> dict:
    """`base` with the keys of `override`, a section that both have merged key by key."""
    merged = dict(base) if isinstance(base, dict) else {}
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(error: jsonschema.ValidationError) -> str:
    key = ".".join(str(p) for p in error.absolute_path) or "(top level)"
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties":
        allowed = ", ".join(sorted(schema.get("properties", {})))
        unknown = ", ".join(
            sorted(set(error.instance) - set(schema.get("properties", {})))
        )
        return f"config section '{key}': unknown key(s) {unknown}; allowed keys: {allowed}"
    if error.validator == "enum":
        allowed = ", ".join(repr(v) for v in error.validator_value)
        return f"config key '{key}': {error.instance!r} is not one of {allowed}"
    if error.validator == "type" and isinstance(error.instance, float) and not math.isfinite(error.instance):
        return f"config key '{key}': {error.instance} is not a finite number"
    if error.validator == "pattern":
        expected = schema.get("x-expected", f"a match of {error.validator_value!r}")
        return f"config key '{key}': {error.instance!r} is not allowed; expected {expected}"
    return f"config key '{key}': {error.message}"


# What YAML 1.1 (PyYAML's, Snakemake's) reads as text although it is a number: an exponent
# without a dot (`1e-3`) or without a sign (`1.5e3`).
EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, schema: dict, typed_as_text: bool = False) -> Any:
    """The config's values as their writer meant them. Where the schema wants a number, text
    that YAML 1.1 leaves as text (EXPONENT: `1e-3`) is read as Python reads it; other text
    where the schema wants no string stays text, for validation to refuse (a wrong type
    stops the run, "20" included). `typed_as_text`: Snakemake's `--config 'train={steps: 20}'`
    delivers nested values as strings, read here as YAML scalars wherever the schema wants
    no string."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        return {k: _coerce(v, properties.get(k, {}), typed_as_text) for k, v in value.items()}
    if isinstance(value, list):
        return [_coerce(v, schema.get("items", {}), typed_as_text) for v in value]
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if not (isinstance(value, str) and types and "string" not in types):
        return value
    if typed_as_text:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
    if isinstance(value, str) and "number" in types and EXPONENT.fullmatch(value):
        return float(value)
    return value


def read_value(key: str, value: Any, typed_as_text: bool = False) -> Any:
    """`value` of the dotted config key `key`, read as `validate` reads it (`1e-3` a number)."""
    node = _coerce(expand_dotted({key: value}), read_schema(), typed_as_text)
    for part in key.split("."):
        node = node[part]
    return node


def _command_line(values: dict) -> dict:
    """Snakemake's --config values (workflow.config_settings.config), typed as the user
    typed them: its nested values arrive as text; a sweep's values (sweep.grid, the
    choices of sweep.random.ranges) are read by the key they set."""
    values = _coerce(expand_dotted(copy.deepcopy(values)), read_schema(), typed_as_text=True)

    def section(value) -> dict:
        return value if isinstance(value, dict) else {}

    def each(key: str, options):
        return [read_value(key, option, typed_as_text=True) for option in options] \
            if isinstance(options, list) else options

    sweep = section(values.get("sweep"))
    grid = section(sweep.get("grid"))
    for key, options in grid.items():
        grid[key] = each(key, options)
    for key, sampled in section(section(sweep.get("random")).get("ranges")).items():
        if isinstance(sampled, dict) and "choice" in sampled:
            sampled["choice"] = each(key, sampled["choice"])
    return values




def filled(config: dict, command_line: dict | None = None) -> dict:
    """A copy of `config` with every default filled in, checked against the schema: ConfigError
    naming each wrong key and what is allowed. `command_line`: the part of `config` that
    Snakemake's --config gave, as it parsed it (nested values as text)."""
    schema = read_schema()
    config = _coerce(expand_dotted(copy.deepcopy(config)), schema)
    if command_line:
        config = merge(config, _command_line(command_line))
    validator_class = _with_defaults(jsonschema.Draft202012Validator)
    errors = sorted(
        validator_class(schema).iter_errors(config), key=lambda e: list(e.path)
    )
    if errors:
        raise ConfigError("\n".join(_describe(e) for e in errors))
    return config


def pick(config: dict, keys) -> dict:
    """The parts of `config` that dotted `keys` name (any depth), nested as in the config."""
    picked: dict = {}
    for key in keys:
        *sections, name = key.split(".")
        source, target = config, picked
        for section in sections:
            source, target = source[section], target.setdefault(section, {})
        target[name] = source[name]
    return picked
