"""The sharded checkpoint format: write a checkpoint from every rank, read and check one.

A checkpoint is a folder `step-XXXXXXXX` (optimizer steps done) under the run's
`train/checkpoints/`:

    shard-RRRRR-of-WWWWW.h5   rank R's part of the parameters and of their optimizer state
    manifest.json             step, training identity, and the size and sha256 of every shard
                              and of history.json
    history.json              the metrics logged up to this step (written by rank 0)
    COMPLETE                  written by rank 0 once every shard is in place

Beside the step folders, `best.json` names the checkpoint that evaluated best
(train.early_stopping's metric), which pruning keeps.

Each rank writes a different 1/W of the bytes (see `partition`), in parallel:
every rank holds the same parameters after a step (data parallelism), and the
optimizer state of its part at least (all of it, or under train.zero 1 exactly
its part: ZeRO-1's ownership is this partition). A shard is an HDF5 file:

    attrs          format, checkpoint_id, step, rank, world_size, identity (JSON),
                   identity_digest, ort_checkpoint_version
    parameters/    per parameter (name %-quoted) the flat slice this shard holds,
                   attrs shape (the whole parameter's), start (first element), requires_grad
    optimizer/     attrs group_name, step (the optimizer's own count), initial_learning_rate;
                   optimizer/<state>/<parameter>, the same slice of each state
                   (AdamW: momentum0, momentum1)
    properties     attrs: ONNX Runtime's property bag (step, lr, samples_seen: the data
                   position; batch order is a function of run.seed and the step, so there
                   is no other random state to keep)

Saving writes the arrays the rank trains on (views of ONNX Runtime's live
parameter buffers and the optimizer's moments, training/optimizer.py) straight
into its shard; resuming copies them back. The same bytes reach the optimizer,
so a resumed run is bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote, unquote

import numpy as np

from .. import atomic, storage
from ..artifacts import Artifacts
from . import checks
from .ort_format import CheckpointError, TrainingState, read_ort_checkpoint

log = logging.getLogger("ortflow.checkpoint")

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
HISTORY = "history.json"  # the run's logged metrics up to the checkpoint's step
BEST = "best.json"  # in the checkpoints root: which checkpoint evaluated best, by which metric
FORMAT = "ortflow-checkpoint-shard/1"
MAX_SHARDS = 99999  # shard names have five digits


@dataclass
class Checkpoint:
    """A verified checkpoint folder: its manifest, the training state of all its shards
    and the metrics logged up to its step (None if it has none)."""

    path: Path
    manifest: dict
    state: TrainingState = field(repr=False)
    history: dict | None = field(default=None, repr=False)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.h5"


def partition(state: TrainingState, world_size: int) -> list[dict[str, tuple[int, int]]]:
    """What each rank writes of `state` (see `cut`)."""
    return cut({name: (array.size, state.nbytes(name)) for name, array in state.parameters.items()}, world_size)


def cut(sizes: dict[str, tuple[int, int]], world_size: int) -> list[dict[str, tuple[int, int]]]:
    """What each rank writes: {parameter: (start, stop)} in flattened elements, from each
    parameter's (elements, bytes with its optimizer state) in `sizes`. The parameters,
    sorted by name, are laid end to end and cut into W runs of equal bytes, so a large
    parameter can span ranks and a model with one huge matrix still splits evenly.
    Integer arithmetic: the same on every rank. A rank's slices of the trainable
    parameters are one run of them laid end to end (sorted by name): ZeRO-1's flat space."""
    total = sum(nbytes for _, nbytes in sizes.values())
    cuts = [total * r // world_size for r in range(world_size + 1)]
    parts: list[dict[str, tuple[int, int]]] = [{} for _ in range(world_size)]
    offset = 0  # bytes of the parameters before this one
    for name in sorted(sizes):
        size, nbytes = sizes[name]
        if size == 0:
            parts[0][name] = (0, 0)
            continue
        per_element = nbytes // size
        bounds = [min(max(-((offset - cut) // per_element), 0), size) for cut in cuts]  # ceil, clamped
        for rank in range(world_size):
            if bounds[rank + 1] > bounds[rank]:
                parts[rank][name] = (bounds[rank], bounds[rank + 1])
        offset += nbytes
    return parts


def write_hdf5(path: Path, state: TrainingState, attrs: dict) -> tuple[int, str]:
    """Write one shard's HDF5 file at `path` and flush it to disk; its (bytes, sha256).
    h5py's default driver writes each array from the rank's own buffers into the file:
    no image of the file is built in memory (a merged checkpoint's is the whole state)."""
    import h5py

    try:
        # Only this process ever opens its temporary file: no HDF5 file lock, which some
        # cluster file systems (NFS, Lustre without flock) refuse.
        with h5py.File(path, "w", locking=False) as f:
            _fill_shard(f, state, attrs)
        return _synced_digest(path)
    except OSError as error:
        raise storage.named(error, path)


def _fill_shard(f, state: TrainingState, attrs: dict) -> None:
    for key, value in attrs.items():
        f.attrs[key] = json.dumps(value, sort_keys=True) if isinstance(value, dict) else value
    params = f.create_group("parameters")
    for name, array in state.parameters.items():
        dataset = params.create_dataset(quote(name, safe=""), data=array)
        dataset.attrs["requires_grad"] = state.requires_grad[name]
        shape, start = state.slices[name]
        dataset.attrs["shape"], dataset.attrs["start"] = np.asarray(shape, dtype=np.int64), start
    optimizer = f.create_group("optimizer")
    for key, value in state.optimizer.items():
        optimizer.attrs[key] = value
    for name, moments in state.optimizer_states.items():
        for moment, array in moments.items():
            optimizer.require_group(moment).create_dataset(quote(name, safe=""), data=array)
    properties = f.create_group("properties")
    for key, value in state.properties.items():
        properties.attrs[key] = np.float32(value) if isinstance(value, float) else value


def _synced_digest(path: Path) -> tuple[int, str]:
    """(bytes, sha256) of the file just written at `path`, read back once from the page cache
    while fsync flushes it to disk: both release the GIL, so they overlap. Read in blocks,
    not mapped: a mapped file's pages count in the rank's peak RSS."""
    from concurrent.futures import ThreadPoolExecutor

    with open(path, "rb") as f, ThreadPoolExecutor(1) as pool:
        synced = pool.submit(os.fsync, f.fileno())
        digest, size = checks.sha256_of(f, os.fstat(f.fileno()).st_size)
        synced.result()
    return size, digest


def read_shard(file, entry: dict | None = None, where=None) -> tuple[dict, TrainingState]:
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


def _shard_contents(f, entry: dict | None, where, size: int) -> tuple[dict, TrainingState]:
    import h5py

    def length(name: str) -> int | None:
        return None if entry is None else entry["parameters"][name][1] - entry["parameters"][name][0]

    attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
    attrs["identity"] = json.loads(attrs["identity"])
    names = [unquote(key) for key in f["parameters"]]
    if entry is not None and sorted(names) != sorted(entry["parameters"]):
        raise CheckpointError(f"shard {where} holds parameters {sorted(names)}; its {MANIFEST} entry lists "
                              f"{sorted(entry['parameters'])}")
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


def write_json(path: Path, obj: dict) -> None:
    atomic.write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def shard_attrs(checkpoint_id: str, step: int, rank: int, world_size: int, identity: dict, identity_digest: str,
                 version: int) -> dict:
    return {"format": FORMAT, "checkpoint_id": checkpoint_id, "step": step, "rank": rank, "world_size": world_size,
            "identity": identity, "identity_digest": identity_digest, "ort_checkpoint_version": version}


def write_shard(folder: Path, state: TrainingState, attrs: dict) -> dict:
    """Write one shard into `folder` (under its temporary name, renamed into place once
    it is on disk and hashed: atomic.file); its manifest entry."""
    name = shard_name(attrs["rank"], attrs["world_size"])
    with atomic.file(folder / name) as tmp:
        size, digest = write_hdf5(tmp, state, attrs)
    return {"file": name, "bytes": size, "sha256": digest,
            "parameters": {n: [start, start + state.parameters[n].size] for n, (_, start) in state.slices.items()}}


def write_history(folder: Path, history: dict) -> dict:
    """Write the metrics logged so far into `folder`; their manifest entry."""
    data = (json.dumps(history, allow_nan=False) + "\n").encode()
    atomic.write_bytes(folder / HISTORY, data)
    return {"file": HISTORY, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def new_manifest(checkpoint_id: str, step: int, world_size: int, identity: dict, identity_digest: str,
              properties: dict, shards: list[dict]) -> dict:
    return {"checkpoint_id": checkpoint_id, "step": step, "world_size": world_size, "identity": identity,
            "identity_digest": identity_digest, "properties": properties, "shards": shards}


def save(root: Path, step: int, part: TrainingState, comm, identity: dict, identity_digest: str, properties: dict,
         keep: int, history: dict | None = None) -> Path:
    """Every rank writes its shard of the checkpoint of optimizer step `step` (steps done so far):
    `part`, its slices (`partition`) of the parameters and of their optimizer state;
    rank 0 also writes `history` (the run's logged metrics so far), so that a resumed run reports all of it."""
    final = step_dir(root, step)
    checkpoint_id = None
    if comm.rank == 0:
        # A folder of this step that is already here is a crashed attempt (or an older run's): replace it.
        if (final / COMPLETE).exists() and digest_of(final) != identity_digest:
            log.info("replacing checkpoint %s of another training identity", final)
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir(parents=True)
        checkpoint_id = f"{step}-{uuid.uuid4().hex}"
    # Also keeps the other ranks from writing before the folder is fresh.
    checkpoint_id = comm.allgather(checkpoint_id)[0]
    part.properties.update(properties)
    attrs = shard_attrs(checkpoint_id, step, comm.rank, comm.world_size, identity, identity_digest, part.version)
    entries = comm.allgather(write_shard(final, part, attrs))
    if comm.rank == 0:
        manifest = new_manifest(checkpoint_id, step, comm.world_size, identity, identity_digest, part.properties,
                                entries)
        if history is not None:
            manifest["history"] = write_history(final, history)
        write_json(final / MANIFEST, manifest)
        atomic.write_bytes(final / COMPLETE, b"")
        _prune(root, identity_digest, keep)
    return final


def _prune(root: Path, identity_digest: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints of this training identity (those of
    another are left alone), and its best one; incomplete ones older than those are
    leftovers of crashes."""
    folders = sorted(p for p in Path(root).glob("step-*") if p.is_dir())
    ours = [p for p in folders if (p / COMPLETE).exists() and digest_of(p) == identity_digest]
    kept = ours[-keep:]
    best_record = best_of(root, identity_digest)
    best = Path(root) / best_record["checkpoint"] if best_record else None
    for folder in folders:
        incomplete = not (folder / COMPLETE).exists()
        if (folder in ours and folder not in kept and folder != best) or (incomplete and kept and folder < kept[0]):
            shutil.rmtree(folder, ignore_errors=True)


def mark_best(root: Path, folder: Path, identity_digest: str, record: dict) -> None:
    """Note (in the root's best.json) that the complete checkpoint `folder` evaluated best:
    `record` says by which metric and value. Only rank 0 calls this."""
    write_json(Path(root) / BEST, {**record, "checkpoint": folder.name, "identity_digest": identity_digest})


def best_of(root: Path, identity_digest: str | None = None) -> dict | None:
    """best.json of the checkpoints root `root` if it is of this training identity (if given), else None;
    its "checkpoint" names the step folder in `root`."""
    record = read_best(root)
    if record is None or identity_digest not in (None, record.get("identity_digest")):
        return None
    return record


def read_best(root: Path) -> dict | None:
    """best.json of the checkpoints root `root`, checked: it names a step folder of the root by its
    plain name (from someone else, it could name any path); None if there is none."""
    path = Path(root) / BEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: not readable as JSON ({error}): the file is damaged") from None
    name = record.get("checkpoint") if isinstance(record, dict) else None
    if not (isinstance(name, str) and re.fullmatch(r"step-\d{8}", name)):
        raise CheckpointError(f"{path}: 'checkpoint' must name a step-XXXXXXXX folder beside it, not {name!r}")
    return record


def digest_of(folder: Path) -> str | None:
    try:
        return _read_manifest(folder / MANIFEST)["identity_digest"]
    except (CheckpointError, KeyError, TypeError):
        return None


def manifest_of(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a folder")
    if not (path / COMPLETE).exists() or not (path / MANIFEST).exists():
        missing = COMPLETE if not (path / COMPLETE).exists() else MANIFEST
        raise CheckpointError(f"checkpoint {path} is incomplete (no {missing}): its run stopped while writing it")
    return _read_manifest(path / MANIFEST)


def _read_manifest(file: Path) -> dict:
    """manifest.json, a regular file (a link to /dev/zero would be read forever) holding a JSON object."""
    with checks.open_listed(file, "manifest", "every checkpoint folder has one") as handle:
        data = handle.read()
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{file}: not readable as JSON ({error}): the file is damaged") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file}: not a JSON object: the file is damaged")
    return manifest


def read_checkpoint(path: Path, model: Path | None = None) -> Checkpoint:
    """Every shard of the checkpoint folder `path`, checked against its manifest (and
    against the parameters of `model`, an artifacts folder or its initial `checkpoint`
    file, if given) before anything large is read, merged. See checkpoint_checks."""
    path = Path(path)
    manifest = manifest_of(path)
    world_size = manifest.get("world_size") if isinstance(manifest, dict) else None
    if not (isinstance(world_size, int) and 1 <= world_size <= MAX_SHARDS):
        raise CheckpointError(f"{path / MANIFEST}: world_size {world_size!r} is not a shard count (1..{MAX_SHARDS})")
    names = [shard_name(rank, world_size) for rank in range(world_size)]
    entries = checks.check_manifest(manifest, path / MANIFEST, names, HISTORY)
    for stray in sorted(path.glob("shard-*.h5")):
        if stray.name not in names:
            raise CheckpointError(f"shard {stray}: not part of this checkpoint (its {MANIFEST} lists "
                                  f"{manifest['world_size']} shards of step {manifest['step']}): shards of two "
                                  "checkpoints are mixed")
    parts = [_checked_shard(path / entry["file"], entry, manifest) for entry in entries]
    history = _checked_history(path, manifest)
    checks.check_parts(parts, names, path)
    if model is not None:
        model = Artifacts(model).checkpoint if Path(model).is_dir() else Path(model)
        optimizer = (manifest.get("identity") or {}).get("optimizer", {}).get("name")
        checks.check_against_model(parts, read_ort_checkpoint(model), optimizer, path, model)
    return Checkpoint(path, manifest, assemble(parts, path), history)


def _open_verified(file: Path, entry: dict, kind: str, missing: str, refuse) -> BinaryIO:
    """A file the manifest lists (its `entry`), opened by checks.open_listed, once its
    size (checked before it is read) and then its sha256 (hashed in blocks) are the
    entry's; `refuse(handle, message)` raises otherwise."""
    handle = checks.open_listed(file, kind, missing)
    try:
        size = os.fstat(handle.fileno()).st_size
        if size != entry["bytes"]:
            refuse(handle, f"{kind} {file}: {size} bytes, {MANIFEST} says {entry['bytes']}: the file is damaged")
        digest, _ = checks.sha256_of(handle, size)
        if digest != entry["sha256"]:
            refuse(handle, f"{kind} {file}: checksum mismatch (sha256 {digest}, {MANIFEST} says "
                           f"{entry['sha256']}): the file is damaged")
    except BaseException:
        handle.close()
        raise
    return handle


def _checked_shard(file: Path, entry: dict, manifest: dict) -> TrainingState:
    """One shard, verified against its manifest `entry`, then its datasets."""
    def refuse(handle, damaged: str) -> None:
        _refuse_changed_shard(handle, file, manifest, damaged)

    with _open_verified(file, entry, "shard", f"{MANIFEST} lists {manifest['world_size']} shards", refuse) as handle:
        return read_shard(handle, entry, file)[1]


def _refuse_changed_shard(handle, file: Path, manifest: dict, damaged: str) -> None:
    """A whole shard of another checkpoint says so in its attributes; anything else is damage."""
    try:
        import h5py

        with h5py.File(handle, "r") as f:
            other = {key: f.attrs[key] for key in ("checkpoint_id", "step")}
    except (OSError, KeyError):
        other = None
    if other and other["checkpoint_id"] != manifest["checkpoint_id"]:
        raise CheckpointError(
            f"shard {file} belongs to another checkpoint (step {other['step']}, id {other['checkpoint_id']}) "
            f"than its {MANIFEST} (step {manifest['step']}, id {manifest['checkpoint_id']}): shards of two "
            "checkpoints are mixed")
    raise CheckpointError(damaged)


def _checked_history(path: Path, manifest: dict) -> dict | None:
    """The metrics logged up to the checkpoint `path`, verified like a shard
    against the manifest's entry of them (None if it has none)."""
    entry = manifest.get("history")
    if entry is None:
        return None
    file = path / entry["file"]

    def refuse(handle, damaged: str) -> None:
        raise CheckpointError(damaged)

    with _open_verified(file, entry, "history file", f"{MANIFEST} lists it", refuse) as handle:
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

