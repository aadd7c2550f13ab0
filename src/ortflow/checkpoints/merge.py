"""A run's sharded checkpoint merged into the files export and quantize read:
ONNX Runtime's checkpoint file (`checkpoint`, with the optimizer state), every shard
in one HDF5 file (`checkpoint.h5`), and `meta.json`, which says which checkpoint it
is (its step, the training identity, and whether it was the last or the best one).
The merge_checkpoint rule runs it (`ortflow checkpoint merge`)."""

from __future__ import annotations

import logging
from pathlib import Path

from .. import atomic
from .best import best_of
from .layout import BEST, partition, shard_attrs
from .meta import Chosen, Merged, write_merged
from .ort_format import CheckpointError, write_ort_checkpoint
from .reader import read_checkpoint
from .resume import checkpoint_folder
from .writer import write_hdf5

log = logging.getLogger("ortflow.checkpoint")


def merge(source: Path, out_dir: Path, identity_digest: str | None = None, model: Path | None = None,
          which: str = "last") -> Path:
    """Merge a checkpoint (a folder, or under a checkpoints root the newest complete one
    (`which` last) or the one that evaluated best (`which` best), of the training identity
    `identity_digest` if given) into `out_dir`: `checkpoint` (ONNX Runtime's format, with
    optimizer state; its tensors in `checkpoint.data` over external_data.threshold()),
    `checkpoint.h5` (every shard in one) and `meta.json`, which says which one it is."""
    best = best_of(source, identity_digest) if which == "best" else None
    if which == "best":
        if best is None:
            raise CheckpointError(
                f"{source}: no best checkpoint of this run (no {BEST}): training keeps one when export.checkpoint "
                "is best (or auto with train.early_stopping.patience set); retrain with that, or export the last "
                "step's with export.checkpoint: last")
        folder = Path(source) / best.checkpoint
    else:
        folder = checkpoint_folder(source, identity_digest)
    checkpoint = read_checkpoint(folder, model)
    manifest = checkpoint.manifest
    attrs = shard_attrs(manifest.checkpoint_id, manifest.step, 0, 1, manifest.identity,
                         manifest.identity_digest, checkpoint.state.version)
    state = checkpoint.state
    chosen = Chosen(which, best.metric, best.mode, best.value) if best else Chosen(which)
    merged = Merged(manifest.checkpoint_id, manifest.step, manifest.world_size, manifest.identity,
                    manifest.identity_digest, manifest.properties, str(checkpoint.path), chosen)
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        # ONNX Runtime's checkpoint (with `checkpoint.data` for a model over external_data.threshold())
        # streamed from the arrays, then the HDF5 file: one serialized copy of the weights at a time.
        write_ort_checkpoint(tmp / "checkpoint", checkpoint.state)
        write_hdf5(tmp / "checkpoint.h5", state.part(partition(state, 1)[0]), attrs)
        write_merged(tmp, merged)
    log.info("merged %s (%d shards, step %d) -> %s", checkpoint.path, manifest.world_size, manifest.step, out_dir)
    return out_dir
