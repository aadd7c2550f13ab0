"""A file a checkpoint's manifest lists, opened only once its size and sha256 are the
manifest's, and a shard that fails that told apart from a shard of another checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from . import checks
from .layout import MANIFEST, Listed, Manifest
from .ort_format import CheckpointError


def open_verified(file: Path, entry: Listed, kind: str, missing: str, refuse) -> BinaryIO:
    """A file the manifest lists (its `entry`), opened by checks.open_listed, once its
    size (checked before it is read) and then its sha256 (hashed in blocks) are the
    entry's; `refuse(handle, message)` raises otherwise."""
    handle = checks.open_listed(file, kind, missing)
    try:
        size = os.fstat(handle.fileno()).st_size
        if size != entry.bytes:
            refuse(handle, f"{kind} {file}: {size} bytes, {MANIFEST} says {entry.bytes}: the file is damaged")
        digest, _ = checks.sha256_of(handle, size)
        if digest != entry.sha256:
            refuse(handle, f"{kind} {file}: checksum mismatch (sha256 {digest}, {MANIFEST} says "
                           f"{entry.sha256}): the file is damaged")
    except BaseException:
        handle.close()
        raise
    return handle


def refuse_changed_shard(handle, file: Path, manifest: Manifest, damaged: str) -> None:
    """A whole shard of another checkpoint says so in its attributes; anything else is damage."""
    try:
        import h5py

        with h5py.File(handle, "r") as f:
            other = {key: f.attrs[key] for key in ("checkpoint_id", "step")}
    except (OSError, KeyError):
        other = None
    if other and other["checkpoint_id"] != manifest.checkpoint_id:
        raise CheckpointError(
            f"shard {file} belongs to another checkpoint (step {other['step']}, id {other['checkpoint_id']}) "
            f"than its {MANIFEST} (step {manifest.step}, id {manifest.checkpoint_id}): shards of two "
            "checkpoints are mixed")
    raise CheckpointError(damaged)
