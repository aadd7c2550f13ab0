"""A readable summary of a checkpoint (`ortflow checkpoint inspect`), made after every
shard is checked: what was checked, its shards, and each parameter with its shape,
dtype, whether it trains, its optimizer state and the shards that hold it."""

from __future__ import annotations

import json
from pathlib import Path

from .layout import HISTORY
from .reader import read_checkpoint
from .resume import checkpoint_folder


def inspect(source: Path, model: Path | None = None) -> str:
    """A readable summary of a checkpoint, after checking every shard."""
    from tabulate import tabulate

    folder = checkpoint_folder(source)
    checkpoint = read_checkpoint(folder, model)
    manifest, state = checkpoint.manifest, checkpoint.state
    where: dict[str, list[str]] = {}
    for entry in manifest.shards:
        for name in entry.parameters:
            where.setdefault(name, []).append(entry.file)
    rows = [(name, "x".join(map(str, state.parameters[name].shape)) or "scalar", str(state.parameters[name].dtype),
             "yes" if state.requires_grad[name] else "frozen", ", ".join(sorted(state.optimizer_states.get(name, {}))),
             ", ".join(where[name])) for name in sorted(state.parameters)]
    shards = [(e.file, e.bytes, e.sha256[:16], len(e.parameters)) for e in manifest.shards]
    return "\n".join([
        f"checkpoint {checkpoint.path}: step {manifest.step}, {manifest.world_size} shards (checksums verified)",
        "checked: shards named in manifest.json as plain files of the folder, regular files (no links) of the "
        "listed sizes; their sha256; every dataset a flat float array stored in its shard, of the listed length; "
        "each parameter's shape covered exactly by its shards",
        f"checked against the model {model}: parameter names, shapes, dtypes, trainable flags, optimizer state"
        if model else "not checked against a model (no artifacts beside the checkpoints; give --artifacts)",
        f"history {HISTORY}: {len(checkpoint.history['train'])} train and {len(checkpoint.history['eval'])} eval "
        "entries, checked like the shards" if checkpoint.history else "no history (the metrics logged up to this step)",
        f"training identity {manifest.identity_digest}",
        f"optimizer {json.dumps(state.optimizer, sort_keys=True)}",
        f"properties {json.dumps(state.properties, sort_keys=True)}",
        "",
        tabulate(shards, headers=["shard", "bytes", "sha256", "parameters"]),
        "",
        tabulate(rows, headers=["parameter", "shape", "dtype", "trained", "optimizer state", "shard"]),
    ])
