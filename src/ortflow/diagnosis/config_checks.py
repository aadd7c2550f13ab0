"""The config given, and the model it built, against this machine: the config valid (or
the defaults, so that the other rows still mean something), the built model's memory at
the config's world size and micro-batch, and its checkpoints on the disk."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import config as config_mod
from ..artifacts import Artifacts
from ..errors import OrtflowError
from ..graphs import pipeline
from ..graphs.description import read_description
from ..training.preflight import FAIL, OK, SKIP, Check, check_checkpoint_disk, check_memory


def check_config(args) -> tuple[Check, config_mod.Config]:
    """The config row, and the config to check the machine against (the defaults
    when the config given is invalid, so the other rows still mean something)."""
    import yaml

    where = "--config-json" if args.config_json else args.config
    try:
        config = config_mod.load_config(args)
    except (OrtflowError, yaml.YAMLError) as error:
        check = Check(
            "config",
            FAIL,
            f"{where}: {'not valid YAML: ' if isinstance(error, yaml.YAMLError) else ''}{error}",
            f"correct it; every key is described in {config_mod.schema_file()}",
        )
        return check, config_mod.typed(config_mod.validate({}))
    return Check("config", OK, f"{where}: valid"), config


def model_checks(args, config: config_mod.Config, world_size: int) -> list[Check]:
    """Whether the built model (--artifacts' model.json) fits this host's memory at the
    config's world size and micro-batch, and its checkpoints the disk."""
    model = Artifacts(args.artifacts or Path("results", config.run.name, "artifacts"))
    if not model.model_json.is_file():
        why = f"skipped: no {model.model_json} (build the artifacts first: snakemake build_artifacts)"
        return [Check("memory", SKIP, why), Check("checkpoint disk", SKIP, why)]
    description, train = read_description(model.model_json), dataclasses.replace(config.train, world_size=world_size)
    return [check_memory(description, train, held=pipeline.held_by_stages(model)),
            check_checkpoint_disk(description, train, Path("results"))]
