"""A config from where a command finds it: a YAML file with overrides, a stage's --config or
--config-json, the earlier run's config that model.weights_config names; and a config with some
keys changed (a sweep's point), validated as loading validates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .convert import as_dict, typed
from .rules import validate
from .schema import expand_dotted, merge
from .sections import Config

# Where the workflow keeps its config, relative to the folder the commands run
# in, as Snakemake reads the Snakefile's `configfile:` (config.load's default).
DEFAULT_CONFIG = Path("config", "config.yaml")


def load(path: str | Path | None = None, overrides: dict | None = None) -> Config:
    """The config file `path` with `overrides` merged in, validated. Without a
    path: config/config.yaml in the working folder if there is one (the
    workflow's), else the schema's defaults, which that file holds too."""
    if path is None and not DEFAULT_CONFIG.is_file():
        return typed(validate(expand_dotted(overrides or {})))
    path = Path(path or DEFAULT_CONFIG)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error(path, error)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(raw).__name__}")
    return typed(validate(merge(expand_dotted(raw), expand_dotted(overrides or {}))))


def replace(config: Config, changes: dict[str, Any]) -> Config:
    """`config` with each dotted key of `changes` set to its value (`{"train.optimizer.lr": 0.01}`),
    validated as `load` validates it, the rules between keys included: all the changes at once,
    since one may need another (pipeline stages that divide the world size). A section given
    whole replaces the section, its left-out keys taking their defaults. A misspelled key or a
    wrong value is refused naming it."""
    data = as_dict(config)
    for key, value in changes.items():
        *sections, name = key.split(".")
        node = data
        for part in sections:
            node = node.setdefault(part, {})  # an unknown section: refused by `validate`, naming it
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{part}' is not a section")
        node[name] = as_dict(value)
    return typed(validate(data))


def add_config_arguments(parser) -> None:
    """`--config FILE` or `--config-json JSON`: how every stage command takes its config."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help=f"config file (YAML; default: {DEFAULT_CONFIG} in the working folder if "
                                          "there is one, else the defaults)")
    source.add_argument("--config-json", help="the config as JSON (what the workflow passes)")


def load_config(args) -> Config:
    """The config of a stage command: the rules pass only the sections a stage needs (`--config-json`)."""
    if args.config_json:
        try:
            config = json.loads(args.config_json)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--config-json: not valid JSON ({error})") from None
        return typed(validate(config, partial=True))
    return load(args.config)


def _yaml_error(path: Path, error: yaml.YAMLError) -> str:
    """`config file my.yaml, line 3, column 2: <what the parser expected>`."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(part) for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part)
    return f"config file {path}{where}: not valid YAML ({problem or error})"


def earlier_run(config: Config) -> dict | None:
    """The validated config of the earlier run whose merged checkpoint
    `model.weights` names, from `model.weights_config` (None without one): the
    workflow runs that run's stages first. Refused in one line: a config of another
    run than the one model.weights names, this run's own output as its weights, and
    a run's checkpoint that is not there and that no config says how to make."""
    model, run = config.model, config.run.name
    weights = Path(model.weights) if model.weights else None
    if weights is None or weights.parts[:1] != ("results",) or len(weights.parts) < 2:
        return None
    if weights.parts[1] == run:
        raise ConfigError(f"config key 'model.weights': {model.weights} is an output of this run ({run!r}); "
                          "name another run's results/<run>/checkpoint")
    if not model.weights_config:
        if not weights.exists():
            raise ConfigError(
                f"config key 'model.weights': {model.weights} does not exist yet; make it first with run "
                f"{weights.parts[1]!r}'s config (snakemake --configfile <its config>), or set model.weights_config to its config file so that "
                "this call runs it first"
            )
        return None
    earlier = load(model.weights_config)
    name = earlier.run.name
    expected = Path("results", name, "checkpoint")
    if name == run or weights != expected:
        raise ConfigError(
            f"config key 'model.weights_config': {model.weights_config} is run {name!r}, whose merged checkpoint "
            f"is {expected}, but model.weights is {model.weights}"
            + ("; it must be another run than this one" if name == run else f"; set model.weights: {expected}")
        )
    return as_dict(earlier)

