"""Checks of a checkpoint folder that someone else may have written, made before
anything large is read or handed to ONNX Runtime.

The sha256 of each shard in manifest.json guards against accidents: a truncated
copy, a flipped bit, shards of two checkpoints mixed in one folder. It proves
nothing about an author who rewrites the manifest with the checksums of shards
they changed. What keeps such a checkpoint from reading outside its folder,
exhausting memory or reaching ONNX Runtime with arrays that do not fit the model
are these checks, each failure a CheckpointError naming the file:

- manifest.json is a regular file, and names every file it lists by its plain
  file name in the folder (each shard `shard-RRRRR-of-WWWWW.h5`, the history
  `history.json`: no separator, no `..`), with its size and sha256;
- every file it lists is a regular file (not a symbolic link, device or FIFO),
  opened without following links, of the size the manifest gives, before it is
  hashed; the history is then a JSON object of `train` and `eval` lists;
- inside a shard every dataset is a one-dimensional array stored in the file
  itself (no link to another file, no external storage), of a float type, as
  long as the manifest's slice of it and no larger than the file;
- across shards, each parameter's `shape` holds exactly the elements its slices
  cover (no 4 TiB `np.empty` from a made-up shape);
- against the model (the artifacts' initial checkpoint, when given): the same
  parameter names, shapes, dtypes and trainable flags, and for each trainable
  parameter the optimizer's moments, each of the parameter's dtype.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..user_files import NotRegular, open_regular
from .layout import Listed, Manifest, ShardEntry
from .ort_format import CheckpointError, TrainingState

SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_DIMS = 32
FLOAT_KINDS = ("float16", "float32", "float64", "bfloat16")
# The optimizer state ONNX Runtime keeps per trainable parameter.
MOMENTS = {"adamw": {"momentum0", "momentum1"}, "sgd": {"momentum0"}, "lamb": {"momentum0", "momentum1"}}


def check_manifest(manifest: Manifest, where: Path, expected_files: list[str], history: str) -> tuple[ShardEntry, ...]:
    """The manifest's shard entries (their fields' types checked by manifest.read_manifest), checked:
    file names, sizes, checksums, slices; and its entry of the history file, if it has one, named `history`."""
    if manifest.step < 0:
        raise CheckpointError(f"{where}: step {manifest.step} is not a count of steps")
    if len(manifest.shards) != len(expected_files):
        raise CheckpointError(f"{where}: 'shards' must list {len(expected_files)} shards (its world_size)")
    for entry, expected in zip(manifest.shards, expected_files):
        check_listed(entry, expected, where, "shard file", "a shard")
        if not all(isinstance(r, list) and len(r) == 2 and all(map(_is_count, r)) and r[0] <= r[1]
                   for r in entry.parameters.values()):
            raise CheckpointError(f"{where}: the entry of {expected} needs parameters ({{name: [start, stop]}})")
    if manifest.history is not None:
        check_listed(manifest.history, history, where, "history file", "the history")
    return manifest.shards


def check_listed(entry: Listed, expected: str, where: Path, kind: str, named: str) -> None:
    """An entry of a file the manifest lists: its plain file name `expected`, its size and sha256."""
    if entry.file != expected:
        raise CheckpointError(f"{where}: {kind} {entry.file!r} is not allowed; {named} is named by its plain file "
                              f"name in the checkpoint folder ({expected!r} here)")
    if not (_is_count(entry.bytes) and SHA256.fullmatch(entry.sha256)):
        raise CheckpointError(f"{where}: the entry of {expected} needs bytes (a count) and sha256 (64 hex digits)")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def open_listed(file: Path, kind: str, missing: str) -> BinaryIO:
    """`file` (a shard, the manifest, a file the manifest lists: `kind`), opened
    without following a link, once it is known to be a regular file (a link to
    /dev/zero would be read forever). `missing` says why it should be there."""
    try:
        return open_regular(file)
    except FileNotFoundError:
        raise CheckpointError(f"{kind} {file} is missing ({missing})") from None
    except NotRegular as error:
        raise CheckpointError(f"{kind} {file} {error.reason}; a {kind} must be a regular file in its checkpoint "
                              "folder") from None


def check_history(history, file: Path) -> dict:
    """The metrics logged up to the checkpoint, as Metrics takes them: {"train": [...], "eval": [...]}."""
    if not (isinstance(history, dict) and all(isinstance(history.get(key), list) for key in ("train", "eval"))):
        raise CheckpointError(f"history file {file}: not the metrics of a run (a JSON object of 'train' and 'eval' "
                              "lists)")
    return history


def sha256_of(handle: BinaryIO, limit: int) -> tuple[str, int]:
    """(sha256, bytes read) of the open file, reading at most `limit` + 1 bytes."""
    digest, size = hashlib.sha256(), 0
    while size <= limit and (block := handle.read(min(1 << 22, limit + 1 - size))):
        digest.update(block)
        size += len(block)
    handle.seek(0)
    return digest.hexdigest(), size


def check_dataset(group, key: str, where, file_size: int, length: int | None):
    """The dataset `group[key]`, once it is a plain 1-D float array of this file, no
    larger than the file and `length` long (the manifest's slice), if given."""
    import h5py

    link = group.get(key, getlink=True)
    dataset = group.get(key) if isinstance(link, h5py.HardLink) else None
    path = f"{group.name}/{key}"
    if not isinstance(dataset, h5py.Dataset) or dataset.external or dataset.is_virtual:
        raise CheckpointError(f"shard {where}: {path} is not an array stored in the shard itself (a link, "
                              "external storage or a group)")
    if dataset.dtype.name not in FLOAT_KINDS or dataset.ndim != 1 or \
            dataset.size * dataset.dtype.itemsize > file_size or length not in (None, dataset.size):
        expected = f" of {length} elements (manifest.json)" if length is not None else ""
        raise CheckpointError(f"shard {where}: {path} is {dataset.dtype} of shape {list(dataset.shape)}; expected "
                              f"a flat float array{expected} no larger than the file")
    return dataset


def check_shape(value, where, path: str) -> tuple[int, ...]:
    shape = np.asarray(value)
    if shape.ndim != 1 or shape.size > MAX_DIMS or shape.dtype.kind not in "iu" or (shape < 0).any():
        raise CheckpointError(f"shard {where}: {path} has shape attribute {value!r}; expected at most {MAX_DIMS} "
                              "non-negative integers")
    return tuple(int(d) for d in shape)


def check_attributes(optimizer: dict, properties: dict, where) -> None:
    """The optimizer's and the property bag's scalars, as ONNX Runtime's checkpoint holds them."""
    types = {"group_name": (str,), "step": (int,), "initial_learning_rate": (float, int)}
    bad = [key for key, value in optimizer.items() if not isinstance(value, types.get(key, ()))]
    bad += [key for key, value in properties.items() if not isinstance(value, (int, float, str))]
    if bad or (optimizer and set(optimizer) != set(types)):
        raise CheckpointError(f"shard {where}: optimizer or property attributes {bad or sorted(optimizer)} are not "
                              "those of an ONNX Runtime checkpoint (group_name, step, initial_learning_rate; "
                              "properties of int, float or str)")


def check_parts(parts: list[TrainingState], names: list[str], where: Path) -> None:
    """Before the whole arrays are allocated: each parameter has one shape, dtype and
    trainable flag in every shard, its optimizer state its dtype, and its slices
    cover exactly its elements."""
    seen: dict[str, tuple] = {}
    covered: dict[str, list[tuple[int, int]]] = {}
    for part, name_of_file in zip(parts, names):
        for name, flat in part.parameters.items():
            shape, start = part.slices[name]
            kind = (shape, flat.dtype, part.requires_grad[name])
            if seen.setdefault(name, kind) != kind:
                raise CheckpointError(f"shard {where / name_of_file}: parameter {name!r} is {kind[1]} of shape "
                                      f"{list(shape)} here but {seen[name][1]} of shape {list(seen[name][0])} in "
                                      "another shard")
            covered.setdefault(name, []).append((start, start + flat.size))
            for moment, array in part.optimizer_states.get(name, {}).items():
                if array.dtype != flat.dtype:
                    raise CheckpointError(f"shard {where / name_of_file}: optimizer/{moment}/{name} is {array.dtype}; "
                                          f"the parameter is {flat.dtype}")
    for name, ranges in covered.items():
        ranges.sort()
        total = math.prod(seen[name][0])
        gapless = ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if not gapless or ranges[-1][1] != total:
            raise CheckpointError(f"checkpoint {where}: parameter {name!r} has shape {list(seen[name][0])} "
                                  f"({total} elements) but its shards hold elements {ranges}")


def check_against_model(parts: list[TrainingState], reference: TrainingState, optimizer: str | None,
                        where: Path, model: Path) -> None:
    """Every parameter of the model `reference` (names, shapes, dtypes, trainable),
    with the optimizer's moments of each trainable one; nothing else."""
    found: dict[str, tuple] = {}
    for part in parts:
        for name, flat in part.parameters.items():
            found[name] = (part.slices[name][0], flat.dtype.name, part.requires_grad[name])
    missing, extra = sorted(set(reference.parameters) - set(found)), sorted(set(found) - set(reference.parameters))
    if missing or extra:
        raise CheckpointError(f"checkpoint {where} does not hold the parameters of the model {model}: "
                              f"missing {missing}, not in the model {extra}")
    for name, array in reference.parameters.items():
        expected = (tuple(array.shape), array.dtype.name, reference.requires_grad[name])
        if found[name] != expected:
            raise CheckpointError(
                f"checkpoint {where}: parameter {name!r} is {found[name][1]} of shape {list(found[name][0])}"
                f"{'' if found[name][2] else ' (frozen)'}; the model {model} has {expected[1]} of shape "
                f"{list(expected[0])}{'' if expected[2] else ' (frozen)'}")
    _check_moments(parts, reference, MOMENTS.get(optimizer), where)


def _check_moments(parts: list[TrainingState], reference: TrainingState, moments: set | None, where: Path) -> None:
    """Each shard holds, for each slice of a trainable parameter, the same slice of
    each of the optimizer's moments (those of `moments`, if the optimizer is known)."""
    for part in parts:
        for name in sorted(set(part.parameters) | set(part.optimizer_states)):
            held = set(part.optimizer_states.get(name, {}))
            if not reference.requires_grad.get(name, False):
                expected = set()
            else:
                expected = moments if moments is not None else held
            if held != expected or name not in part.parameters:
                raise CheckpointError(f"checkpoint {where}: parameter {name!r} has optimizer state {sorted(held)} "
                                      f"in a shard; expected {sorted(expected)}")
