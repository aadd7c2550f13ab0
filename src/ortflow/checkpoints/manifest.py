"""A checkpoint folder's manifest.json (its record: layout.Manifest) read here only, every field
checked (records.py) before checks.py checks what it names, and written as ortflow has always
written it (sorted keys, no `history` entry in a checkpoint saved without one)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .. import records
from . import checks
from .layout import Manifest
from .ort_format import CheckpointError

REMEDY = "the file is damaged"


def read_manifest(file: Path) -> Manifest:
    """manifest.json, a regular file (a link to /dev/zero would be read forever), as a record;
    CheckpointError naming the file (and the key of a missing or mistyped field) otherwise."""
    with checks.open_listed(file, "manifest", "every checkpoint folder has one") as handle:
        data = handle.read()
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{file}: not readable as JSON ({error}): {REMEDY}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file}: not a JSON object: {REMEDY}")
    return records.build(Manifest, manifest, file, CheckpointError, REMEDY)


def write_manifest(file: Path, manifest: Manifest) -> None:
    data = dataclasses.asdict(manifest)
    if manifest.history is None:
        del data["history"]
    records.write_data(file, data, sort_keys=True)
