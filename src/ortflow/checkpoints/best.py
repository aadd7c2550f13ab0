"""best.json beside the step folders: which checkpoint evaluated best
(train.early_stopping's metric), which pruning keeps and export can choose. Read here only, every
field checked (records.py); written as ortflow has always written it (sorted keys)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .. import records
from .layout import BEST
from .ort_format import CheckpointError

REMEDY = "the file is damaged"


@dataclasses.dataclass(frozen=True)
class BestCheckpoint:
    step: int | None
    metric: str  # train.early_stopping.metric
    mode: str  # min or max
    value: float | None
    checkpoint: str  # the step folder beside best.json, by its plain name
    identity_digest: str  # the training identity of the run that wrote it


def mark_best(root: Path, folder: Path, identity_digest: str, record: dict) -> None:
    """Note (in the root's best.json) that the complete checkpoint `folder` evaluated best:
    `record` (training/best.py's describe) says by which metric and value. Only rank 0 calls this."""
    write_best(root, BestCheckpoint(**record, checkpoint=folder.name, identity_digest=identity_digest))


def write_best(root: Path, best: BestCheckpoint) -> None:
    records.write(Path(root) / BEST, best, sort_keys=True)


def best_of(root: Path, identity_digest: str | None = None) -> BestCheckpoint | None:
    """best.json of the checkpoints root `root` if it is of this training identity (if given), else None;
    its `checkpoint` names the step folder in `root`."""
    best = read_best(root)
    if best is None or identity_digest not in (None, best.identity_digest):
        return None
    return best


def read_best(root: Path) -> BestCheckpoint | None:
    """best.json of the checkpoints root `root`, checked: it names a step folder of the root by its
    plain name (from someone else, it could name any path); None if there is none."""
    path = Path(root) / BEST
    if not path.is_file():
        return None
    best = records.read(BestCheckpoint, path, CheckpointError, REMEDY)
    if not re.fullmatch(r"step-\d{8}", best.checkpoint):
        raise CheckpointError(f"{path}: 'checkpoint' must name a step-XXXXXXXX folder beside it, not "
                              f"{best.checkpoint!r}")
    return best
