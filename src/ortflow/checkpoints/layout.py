"""The sharded checkpoint format: the names and layout that writer.py writes and reader.py
reads and checks; best.py marks the best checkpoint, retention.py prunes the others.

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

from dataclasses import dataclass, field
from pathlib import Path

from .ort_format import TrainingState

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
HISTORY = "history.json"  # the run's logged metrics up to the checkpoint's step
BEST = "best.json"  # in the checkpoints root: which checkpoint evaluated best, by which metric
FORMAT = "ortflow-checkpoint-shard/1"
MAX_SHARDS = 99999  # shard names have five digits


@dataclass(frozen=True)
class Listed:
    """A file the manifest lists, by its plain name in the folder, with its size and sha256."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardEntry(Listed):
    parameters: dict  # {name: [start, stop]}: the flat slice of each parameter the shard holds


@dataclass(frozen=True)
class Manifest:
    """manifest.json (read and written by manifest.py, every field checked as it is read)."""

    checkpoint_id: str  # "<step>-<uuid>", in every shard's attributes too
    step: int  # optimizer steps done
    world_size: int  # its number of shards
    identity: dict  # the training identity (config.training_identity)
    identity_digest: str
    properties: dict  # ONNX Runtime's property bag (step, lr, samples_seen)
    shards: tuple[ShardEntry, ...]
    history: Listed | None = None  # the metrics logged up to the step; none in checkpoints saved before


@dataclass
class Checkpoint:
    """A verified checkpoint folder: its manifest, the training state of all its shards
    and the metrics logged up to its step (None if it has none)."""

    path: Path
    manifest: Manifest
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


def shard_attrs(checkpoint_id: str, step: int, rank: int, world_size: int, identity: dict, identity_digest: str,
                 version: int) -> dict:
    return {"format": FORMAT, "checkpoint_id": checkpoint_id, "step": step, "rank": rank, "world_size": world_size,
            "identity": identity, "identity_digest": identity_digest, "ort_checkpoint_version": version}
