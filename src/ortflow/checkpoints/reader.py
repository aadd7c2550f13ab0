"""Reading a checkpoint: its manifest, then every shard verified against it (verify.py)
and checked (checks.py) before anything large is read, assembled into one state."""

from __future__ import annotations

import json
import math
from pathlib import Path
from urllib.parse import unquote

import numpy as np

from ..artifacts import Artifacts
from . import checks
from .layout import COMPLETE, HISTORY, MANIFEST, MAX_SHARDS, Checkpoint, Manifest, ShardEntry, shard_name
from .manifest import read_manifest
from .ort_format import CheckpointError, TrainingState, read_ort_checkpoint
from .verify import open_verified, refuse_changed_shard


def read_shard(file, entry: ShardEntry | None = None, where=None) -> tuple[dict, TrainingState]:
    """(attrs, part) of one shard (a path or an open file); `part.slices` says where its
    flat arrays belong. Each dataset is checked before it is read, against the manifest's
    `entry` of the shard if given (checkpoint_checks)."""
    import h5py

    where = where or file
    try:
        with h5py.File(file, "r") as f:
            size = f.id.get_filesize()
            return _shard_contents(f, entry, where, size)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as error:
        raise CheckpointError(f"shard {where}: not a readable ortflow checkpoint shard ({error})") from None


def _shard_contents(f, entry: ShardEntry | None, where, size: int) -> tuple[dict, TrainingState]:
    import h5py

    def length(name: str) -> int | None:
        return None if entry is None else entry.parameters[name][1] - entry.parameters[name][0]

    attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
    attrs["identity"] = json.loads(attrs["identity"])
    names = [unquote(key) for key in f["parameters"]]
    if entry is not None and sorted(names) != sorted(entry.parameters):
        raise CheckpointError(f"shard {where} holds parameters {sorted(names)}; its {MANIFEST} entry lists "
                              f"{sorted(entry.parameters)}")
    parameters, requires_grad, slices = {}, {}, {}
    for key, name in zip(f["parameters"], names):
        dataset = checks.check_dataset(f["parameters"], key, where, size, length(name))
        shape = checks.check_shape(dataset.attrs["shape"], where, dataset.name)
        parameters[name], requires_grad[name] = dataset[()], bool(dataset.attrs["requires_grad"])
        slices[name] = (shape, int(dataset.attrs["start"]))
    optimizer = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f["optimizer"].attrs.items()}
    states: dict[str, dict[str, np.ndarray]] = {}
    for moment, group in f["optimizer"].items():
        if not isinstance(group, h5py.Group):
            raise CheckpointError(f"shard {where}: optimizer/{moment} is not a group of optimizer state")
        for key in group:
            if unquote(key) not in parameters:
                raise CheckpointError(f"shard {where}: optimizer/{moment}/{key} is the state of a parameter that "
                                      "the shard does not hold")
            dataset = checks.check_dataset(group, key, where, size, parameters[unquote(key)].size)
            states.setdefault(unquote(key), {})[moment] = dataset[()]
    properties = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f["properties"].attrs.items()}
    checks.check_attributes(optimizer, properties, where)
    return attrs, TrainingState(parameters, requires_grad, states, optimizer, properties,
                                attrs["ort_checkpoint_version"], slices)


def assemble(parts: list[TrainingState], where: Path) -> TrainingState:
    """The whole state from the parts of every shard of the checkpoint `where`. A parameter
    that one shard holds whole (all but at most W-1 of them: `cut`) keeps that shard's
    array, reshaped, with its optimizer state: only the parameters cut between shards are
    copied, so the merged state does not sit in memory twice."""
    parameters: dict[str, np.ndarray] = {}
    states: dict[str, dict[str, np.ndarray]] = {}
    requires_grad, filled = {}, {}
    for part in parts:
        for name, flat in part.parameters.items():
            shape, start = part.slices[name]
            moments = part.optimizer_states.get(name, {})
            requires_grad[name] = part.requires_grad[name]
            if flat.size == math.prod(shape) and name not in parameters:
                parameters[name], filled[name] = flat.reshape(shape), flat.size
                if moments:
                    states[name] = {moment: array.reshape(shape) for moment, array in moments.items()}
                continue
            if name not in parameters:
                parameters[name], filled[name] = np.empty(shape, flat.dtype), 0
            parameters[name].reshape(-1)[start:start + flat.size] = flat
            filled[name] += flat.size
            for moment, array in moments.items():
                whole = states.setdefault(name, {}).setdefault(moment, np.empty(shape, array.dtype))
                whole.reshape(-1)[start:start + array.size] = array
    short = sorted(n for n in parameters if filled[n] != parameters[n].size)
    if short:
        raise CheckpointError(f"checkpoint {where}: its shards do not cover all of {short}")
    first = parts[0]
    return TrainingState(parameters, requires_grad, states, first.optimizer, first.properties, first.version)


def digest_of(folder: Path) -> str | None:
    try:
        return read_manifest(folder / MANIFEST).identity_digest
    except CheckpointError:
        return None


def manifest_of(path: Path) -> Manifest:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a folder")
    if not (path / COMPLETE).exists() or not (path / MANIFEST).exists():
        missing = COMPLETE if not (path / COMPLETE).exists() else MANIFEST
        raise CheckpointError(f"checkpoint {path} is incomplete (no {missing}): its run stopped while writing it")
    return read_manifest(path / MANIFEST)


def read_checkpoint(path: Path, model: Path | None = None) -> Checkpoint:
    """Every shard of the checkpoint folder `path`, checked against its manifest (and
    against the parameters of `model`, an artifacts folder or its initial `checkpoint`
    file, if given) before anything large is read, merged. See checkpoint_checks."""
    path = Path(path)
    manifest = manifest_of(path)
    if not 1 <= manifest.world_size <= MAX_SHARDS:
        raise CheckpointError(f"{path / MANIFEST}: world_size {manifest.world_size!r} is not a shard count "
                              f"(1..{MAX_SHARDS})")
    names = [shard_name(rank, manifest.world_size) for rank in range(manifest.world_size)]
    entries = checks.check_manifest(manifest, path / MANIFEST, names, HISTORY)
    for stray in sorted(path.glob("shard-*.h5")):
        if stray.name not in names:
            raise CheckpointError(f"shard {stray}: not part of this checkpoint (its {MANIFEST} lists "
                                  f"{manifest.world_size} shards of step {manifest.step}): shards of two "
                                  "checkpoints are mixed")
    parts = [_checked_shard(path / entry.file, entry, manifest) for entry in entries]
    history = _checked_history(path, manifest)
    checks.check_parts(parts, names, path)
    if model is not None:
        model = Artifacts(model).checkpoint if Path(model).is_dir() else Path(model)
        optimizer = manifest.identity.get("optimizer", {}).get("name")
        checks.check_against_model(parts, read_ort_checkpoint(model), optimizer, path, model)
    return Checkpoint(path, manifest, assemble(parts, path), history)


def _checked_shard(file: Path, entry: ShardEntry, manifest: Manifest) -> TrainingState:
    """One shard, verified against its manifest `entry`, then its datasets."""
    def refuse(handle, damaged: str) -> None:
        refuse_changed_shard(handle, file, manifest, damaged)

    with open_verified(file, entry, "shard", f"{MANIFEST} lists {manifest.world_size} shards", refuse) as handle:
        return read_shard(handle, entry, file)[1]


def _checked_history(path: Path, manifest: Manifest) -> dict | None:
    """The metrics logged up to the checkpoint `path`, verified like a shard
    against the manifest's entry of them (None if it has none)."""
    entry = manifest.history
    if entry is None:
        return None
    file = path / entry.file

    def refuse(handle, damaged: str) -> None:
        raise CheckpointError(damaged)

    with open_verified(file, entry, "history file", f"{MANIFEST} lists it", refuse) as handle:
        data = handle.read()
    try:
        history = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"history file {file}: not readable as JSON ({error})") from None
    return checks.check_history(history, file)


def load_parameters(path: Path) -> dict:
    """{name: array} of every parameter of the checkpoint folder `path`."""
    return read_checkpoint(Path(path)).state.parameters


def load_parameters_file(path: Path) -> dict:
    """{name: array} of every parameter of an ONNX Runtime checkpoint file."""
    return {name: array.copy() for name, array in read_ort_checkpoint(path).parameters.items()}
