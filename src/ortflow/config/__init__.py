"""The run configuration: load, validate against the JSON schema, fill defaults,
and derive the hashes that decide what a checkpoint or an artifact belongs to."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import types
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ..errors import ConfigError
from .sections import SECTIONS, Config

# Where the workflow keeps its config, relative to the folder the commands run
# in, as Snakemake reads the Snakefile's `configfile:` (config.load's default).
DEFAULT_CONFIG = Path("config", "config.yaml")
# Every key, its default and its allowed values: package data of ortflow (pyproject.toml's
# package-data), so that the workflow and an installed ortflow read the same file.
SCHEMA = "config.schema.yaml"


def schema_file():
    """The schema file, found through importlib.resources, wherever ortflow is installed
    (beside this package, in ortflow's own folder)."""
    return resources.files("ortflow") / SCHEMA


@functools.cache
def _schema() -> dict:
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
            out[key] = _merge(out[key], value)
            continue
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{part}' is not a section")
        node[parts[-1]] = _merge(node.get(parts[-1]), value) if isinstance(value, dict) else value
    return out


def _merge(base: Any, override: dict) -> dict:
    merged = dict(base) if isinstance(base, dict) else {}
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
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
    node = _coerce(expand_dotted({key: value}), _schema(), typed_as_text)
    for part in key.split("."):
        node = node[part]
    return node


def _command_line(values: dict) -> dict:
    """Snakemake's --config values (workflow.config_settings.config), typed as the user
    typed them: its nested values arrive as text; a sweep's values (sweep.grid, the
    choices of sweep.random.ranges) are read by the key they set."""
    values = _coerce(expand_dotted(copy.deepcopy(values)), _schema(), typed_as_text=True)

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


def validate(config: dict, partial: bool = False, command_line: dict | None = None) -> dict:
    """Return a validated copy of `config` with every default filled in.
    Raises ConfigError naming the key and what is allowed. `partial`: the
    config holds only the sections one stage needs (what the rules pass), so
    the rules that relate keys of different sections were checked before.
    `command_line`: the part of `config` that Snakemake's --config gave, as it
    parsed it (nested values as text)."""
    schema = _schema()
    config = _coerce(expand_dotted(copy.deepcopy(config)), schema)
    if command_line:
        config = _merge(config, _command_line(command_line))
    validator_class = _with_defaults(jsonschema.Draft202012Validator)
    errors = sorted(
        validator_class(schema).iter_errors(config), key=lambda e: list(e.path)
    )
    if errors:
        raise ConfigError("\n".join(_describe(e) for e in errors))
    _resolve_eps(config["train"]["optimizer"])
    # Resolved here, once: a sweep's repeats change run.seed on a config validated before,
    # and keep its split (sweep.points).
    if config["data"]["split_seed"] is None:
        config["data"]["split_seed"] = config["run"]["seed"]
    if not partial:
        _default_tokenizer(config)
        _check_cross_keys(typed(config))
    return config


def _default_tokenizer(config: dict) -> None:
    """A `kind: transformers` model's data.tokenizer, for text, is its folder's own tokenizer when
    the config names none and the folder has one; without one, text is read as bytes.
    Its model.task seq2seq makes data.task seq2seq."""
    from ..user_files import TOKENIZER_FILES

    model, data = config["model"], config["data"]
    if model["kind"] == "transformers" and model["task"] == "seq2seq" and data["task"] == "auto":
        data["task"] = "seq2seq"  # the data stage tokenizes data.label's target texts
    if model["kind"] != "transformers" or not model["path"] or data["tokenizer"] is not None:
        return
    is_text = data["source"] == "text" or Path(data["source"]).suffix.lower() == ".txt" or data["text"]
    folder = Path(model["path"])
    if is_text and any((folder / name).is_file() for name in TOKENIZER_FILES if name != "config.json"):
        data["tokenizer"] = model["path"]


# Each optimizer's own epsilon, train.optimizer.eps's null: torch.optim.AdamW's, and
# the TrainingRunner's LAMB's (its LambOptimizer's default). SGD has none; it keeps
# AdamW's, so that its runs' training identity is unchanged.
OPTIMIZER_EPS = {"adamw": 1e-8, "sgd": 1e-8, "lamb": 1e-6}


def _resolve_eps(optimizer: dict) -> None:
    if optimizer["eps"] is None:
        optimizer["eps"] = OPTIMIZER_EPS[optimizer["name"]]


def _check_cross_keys(config: Config) -> None:
    model, train, data = config.model, config.train, config.data
    if model.kind in ("onnx", "torch", "transformers") and not model.path:
        raise ConfigError(
            f"config key 'model.path': required when model.kind is '{model.kind}' "
            "(an .onnx file, `package.module:Class` for torch, a save_pretrained folder for transformers)"
        )
    if model.task != "auto" and model.kind != "transformers":
        raise ConfigError(
            f"config key 'model.task': {model.task!r} picks the head of a `kind: transformers` model; model.kind is "
            f"{model.kind!r} (leave model.task out, or set model.kind: transformers)"
        )
    if model.kind == "gpt" and data.source != "text" and not data.source.endswith(".txt"):
        raise ConfigError(
            f"config key 'model.kind': 'gpt' needs text data (data.source: text or a .txt file), "
            f"got data.source={data.source!r}"
        )
    if model.kind == "gpt" and model.width % model.heads:
        raise ConfigError(
            f"config key 'model.heads': {model.heads} does not divide model.width={model.width}"
        )
    _check_text_keys(data)
    _check_libraries(model)
    check_lamb_sharding(train)
    if train.backend == "nccl" and train.device != "cuda":
        raise ConfigError("config key 'train.backend': 'nccl' needs train.device: cuda")
    if train.world_size % train.pipeline_stages:
        raise ConfigError(f"config key 'train.world_size': {train.world_size} ranks do not divide into "
                          f"train.pipeline_stages={train.pipeline_stages} stages; make it a multiple of it")
    # What the pipeline stages (training/pipeline_schedule.py) do not do yet, each with the value that works.
    for key, value, works in (("device", train.device, "cpu"), ("profile_steps", train.profile_steps, None)):
        if train.pipeline_stages > 1 and value != works:
            value = list(value) if isinstance(value, tuple) else value  # as the user wrote it, not as typed
            raise ConfigError(f"config key 'train.{key}': {value!r} is not applied to pipeline stages yet "
                              f"(train.pipeline_stages={train.pipeline_stages}); set train.{key}: "
                              f"{'null' if works is None else works}")
    if train.nodes > train.world_size:
        raise ConfigError(
            f"config key 'train.nodes': {train.nodes} nodes for train.world_size={train.world_size} ranks; "
            "every node needs at least one rank"
        )
    profile = train.profile_steps
    if profile and profile[0] > profile[1]:
        raise ConfigError(f"config key 'train.profile_steps': first {profile[0]} is after last {profile[1]}")
    for key in ("weights_skip", "weights_prefix", "weights_config"):
        if getattr(model, key) and not model.weights:
            raise ConfigError(f"config key 'model.{key}': set without model.weights, which it is about")


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


def _check_libraries(model) -> None:
    """The libraries that `model.kind: transformers` and `model.lora` need, which the package's
    `transformers` extra installs: said before any stage starts, rather than as an ImportError in one."""
    from importlib.util import find_spec

    needs = {"model.kind: transformers": ["transformers"] if model.kind == "transformers" else [],
             "model.lora": ["peft"] if model.lora is not None else []}
    for key, libraries in needs.items():
        missing = [name for name in libraries if find_spec(name) is None]
        if missing:
            raise ConfigError(f"config key '{key.split(':')[0]}': {key} needs the {missing[0]} library, which is "
                              "not installed: pip install 'ortflow[transformers]'")


def check_lamb_sharding(train) -> None:
    """Refuse `train.zero: 1` with LAMB: the trust ratio is the norm of a whole tensor."""
    if train.optimizer.name == "lamb" and train.zero:
        raise ConfigError(
            f"config key 'train.zero': {train.zero} gives each rank slices of the optimizer's tensors, but "
            "LAMB's trust ratio needs the norm of each whole tensor; set train.zero: 0 with lamb, "
            "or use train.optimizer.name: adamw with ZeRO")


def _check_text_keys(data) -> None:
    """data.text needs a table and data.tokenizer; data.tokenizer needs text to tokenize."""
    source = data.source
    suffix = Path(source).suffix.lower()
    is_text = source == "text" or suffix == ".txt"
    text = [data.text] if isinstance(data.text, str) else data.text or []
    if text and suffix not in (".csv", ".parquet", ".jsonl"):
        raise ConfigError(f"config key 'data.text': text columns are read from a .csv, .parquet or .jsonl file, "
                          f"not data.source={source!r}")
    if text and not data.tokenizer:
        raise ConfigError("config key 'data.text': needs data.tokenizer (a tokenizer.json file or a "
                          "save_pretrained folder) to turn the text into token ids")
    if data.task == "seq2seq" and not text:
        raise ConfigError("config key 'data.task': seq2seq reads source texts from data.text and target texts "
                          "from data.label, columns of a .csv, .parquet or .jsonl file; set data.text")
    if data.label in text:
        raise ConfigError(f"config key 'data.text': {data.label!r} is data.label too; the model would read "
                          "the answer")
    if data.tokenizer and not text and not is_text:
        raise ConfigError(f"config key 'data.tokenizer': tokenizes text, data.source 'text' or a .txt file, or the "
                          f"columns named by data.text; data.source={source!r} has neither (set data.text)")


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
    return typed(validate(_merge(expand_dotted(raw), expand_dotted(overrides or {}))))


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


def global_batch_size(config: Config) -> int:
    train = config.train
    return train.micro_batch_size * train.grad_accum_steps * data_parallel_size(train)


def data_parallel_size(train) -> int:
    """D: the copies of the model (of each of its train.pipeline_stages stages) that split the global batch."""
    return train.world_size // train.pipeline_stages


def training_identity(config: Config) -> dict:
    """What a checkpoint belongs to: resuming is only meaningful if all of this is
    unchanged. World size and the periods may change; the step count too unless the
    learning-rate schedule spreads its decay over it. The user's model and data
    files count by their content, not their path."""
    train = config.train
    identity = {
        "seed": config.run.seed,
        "data": by_content(as_dict(config.data)),
        "model": by_content(as_dict(config.model)),
        "optimizer": as_dict(train.optimizer),
        "lr_schedule": as_dict(train.lr_schedule),
        "clip_grad_norm": train.clip_grad_norm,
        "global_batch_size": global_batch_size(config),
    }
    if train.lr_schedule.name != "constant":
        identity["steps"] = train.steps
    return identity


def export_checkpoint(config: Config) -> str:
    """`best` or `last`: the checkpoint export.checkpoint picks, `auto` resolved."""
    chosen = config.export.checkpoint
    if chosen == "auto":
        return "best" if config.train.early_stopping.patience else "last"
    return chosen


# Keys whose files are listed, checked and hashed by user_files (section key -> config key;
# model.path for kind transformers): only these may name a folder, hashed by the files its loader reads, so that a value such
# as `text` or `auto` never reads a folder that happens to have its name.
CHECKED_KEYS = {"tokenizer": "data.tokenizer", "weights": "model.weights", "path": "model.path"}


def by_content(section: dict) -> dict:
    """`section` with each value that names a file replaced by `sha256:<digest>` of the file,
    and a folder of CHECKED_KEYS (a save_pretrained tokenizer, model.weights' merged
    checkpoint of an earlier run) by the digest of the digests of the files read from it."""
    from .. import user_files
    from ..digests import sha256_file

    checked = dict(CHECKED_KEYS)
    if section.get("kind") != "transformers":  # model.path is a folder for kind transformers only
        del checked["path"]

    def content(key: str, value):
        path = Path(value) if isinstance(value, str) else None
        if path is not None and key in checked and (path.exists() or path.is_symlink()):
            return user_files.content(checked[key], value)
        if path is not None and path.is_file():
            return f"sha256:{sha256_file(path)}"
        return value

    return {key: content(key, value) for key, value in section.items()}


# --- the typed config ------------------------------------------------------------------------------
# After `validate`, code reads the config as frozen dataclasses, one per section of the schema
# (`config.train.optimizer.lr`), generated from the schema into sections.py: it stays the one source
# of the keys. A list becomes a tuple and a free-form mapping (model.kwargs, sweep.grid) a read-only one.


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
    return _frozen(validated, _schema(), "")


def as_dict(value: Any) -> Any:
    """A typed config, or a section or value of one, as plain JSON-able data again."""
    if dataclasses.is_dataclass(value):
        return {field.name: as_dict(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (dict, types.MappingProxyType)):
        return {key: as_dict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_dict(item) for item in value]
    return value

