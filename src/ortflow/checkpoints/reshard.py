"""A checkpoint rewritten as a checkpoint folder of another number of shards
(`ortflow checkpoint reshard`). Training resumes from any world size anyway; this is
for tools that want the other layout."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from .. import atomic
from .layout import COMPLETE, MANIFEST, partition, shard_attrs
from .manifest import write_manifest
from .reader import read_checkpoint
from .resume import checkpoint_folder
from .writer import write_history, write_shard

log = logging.getLogger("ortflow.checkpoint")


def reshard(source: Path, out_dir: Path, world_size: int, model: Path | None = None) -> Path:
    """Write the checkpoint `source` (a folder, or a checkpoints root's newest complete one) as
    a checkpoint folder `out_dir` of `world_size` shards, with its history."""
    folder = checkpoint_folder(source)
    checkpoint = read_checkpoint(folder, model)
    manifest, state = checkpoint.manifest, checkpoint.state
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        entries = []
        for rank, ranges in enumerate(partition(state, world_size)):
            attrs = shard_attrs(manifest.checkpoint_id, manifest.step, rank, world_size,
                                 manifest.identity, manifest.identity_digest, state.version)
            entries.append(write_shard(tmp, state.part(ranges), attrs))
        # The metrics logged up to this step: a run resumed from the copy still reports all of them.
        history = write_history(tmp, checkpoint.history) if checkpoint.history is not None else None
        write_manifest(tmp / MANIFEST, dataclasses.replace(manifest, world_size=world_size, shards=tuple(entries),
                                                           history=history))
        atomic.write_bytes(tmp / COMPLETE, b"")
    log.info("resharded %s (%d shards) -> %s (%d shards)", checkpoint.path, manifest.world_size, out_dir,
             world_size)
    return out_dir
