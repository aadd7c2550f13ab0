"""Writing a checkpoint: every rank its shard, in parallel, then rank 0 the manifest and
COMPLETE (the format: layout.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from urllib.parse import quote

import numpy as np

from .. import atomic, storage
from . import checks
from .layout import COMPLETE, HISTORY, MANIFEST, Listed, Manifest, ShardEntry, shard_attrs, shard_name, step_dir
from .manifest import write_manifest
from .ort_format import TrainingState
from .reader import digest_of
from .retention import prune

log = logging.getLogger("ortflow.checkpoint")


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


def write_shard(folder: Path, state: TrainingState, attrs: dict) -> ShardEntry:
    """Write one shard into `folder` (under its temporary name, renamed into place once
    it is on disk and hashed: atomic.file); its manifest entry."""
    name = shard_name(attrs["rank"], attrs["world_size"])
    with atomic.file(folder / name) as tmp:
        size, digest = write_hdf5(tmp, state, attrs)
    return ShardEntry(name, size, digest,
                      {n: [start, start + state.parameters[n].size] for n, (_, start) in state.slices.items()})


def write_history(folder: Path, history: dict) -> Listed:
    """Write the metrics logged so far into `folder`; their manifest entry."""
    data = (json.dumps(history, allow_nan=False) + "\n").encode()
    atomic.write_bytes(folder / HISTORY, data)
    return Listed(HISTORY, len(data), hashlib.sha256(data).hexdigest())


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
        listed = write_history(final, history) if history is not None else None
        write_manifest(final / MANIFEST, Manifest(checkpoint_id, step, comm.world_size, identity, identity_digest,
                                                  part.properties, tuple(entries), listed))
        atomic.write_bytes(final / COMPLETE, b"")
        prune(root, identity_digest, keep)
    return final
