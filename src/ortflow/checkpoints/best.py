"""best.json beside the step folders: which checkpoint evaluated best
(train.early_stopping's metric), which pruning keeps and export can choose."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .layout import BEST, write_json
from .ort_format import CheckpointError


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

