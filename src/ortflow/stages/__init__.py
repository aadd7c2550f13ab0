"""The stage commands, one module a Snakemake rule (`ortflow <command>`, cli.py): each
reads as its stage's steps and imports the libraries beside this package, never
another stage (tests/test_imports.py).

Each stage module declares the config keys it reads, `KEYS` (report.py one list a
subcommand), a tuple of dotted keys written as a literal; the rules pass a stage exactly
those (`config_json(*...)`, workflow/rules/common.smk), read here without importing the
stage: its libraries (torch for export) would slow every parse of the Snakefile."""

from __future__ import annotations

import ast
from pathlib import Path

from ..errors import ConfigError

FOLDER = Path(__file__).parent


def declared_keys(stage: str, name: str = "KEYS") -> tuple[str, ...]:
    """The literal tuple `name` of stage module `stage` (stages/<stage>.py): the keys it reads."""
    path = FOLDER / f"{stage}.py"
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            try:
                keys = ast.literal_eval(node.value)
            except ValueError:
                keys = None
            if not (isinstance(keys, tuple) and keys and all(isinstance(k, str) for k in keys)):
                raise ConfigError(f"{path}:{node.lineno}: {name} must be a tuple of dotted config keys, "
                                  "written as a literal")
            return keys
    raise ConfigError(f"{path}: declares no {name} (the config keys the stage reads, a tuple of dotted keys)")
