"""A merged checkpoint's meta.json (merge.py writes it): which checkpoint it is (its step, the
training identity, whether it was the last or the best one), read by export and the run's summary.
Read here only, every field checked (records.py); written as ortflow has always written it
(sorted keys; `chosen` of the last checkpoint without the best one's metric, mode and value)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import records
from ..errors import MissingInputError
from .ort_format import CheckpointError

META = "meta.json"  # in the merged checkpoint's folder
REMEDY = "run the merge_checkpoint rule again"


@dataclasses.dataclass(frozen=True)
class Chosen:
    """export.checkpoint's choice: the last checkpoint, or the best by an eval metric (best.json's)."""

    checkpoint: str  # last or best
    metric: str | None = None
    mode: str | None = None  # min or max
    value: float | None = None

    def shown(self) -> str:
        """`best (eval loss 0.1234)` or `last`."""
        return f"best (eval {self.metric} {self.value:.6g})" if self.checkpoint == "best" else self.checkpoint


@dataclasses.dataclass(frozen=True)
class Merged:
    checkpoint_id: str
    step: int
    world_size: int  # the shards it was merged from
    identity: dict
    identity_digest: str
    properties: dict
    merged_from: str  # the checkpoint folder
    chosen: Chosen = Chosen("last")  # absent from merges before export.checkpoint: the last


def read_merged(folder: Path) -> Merged:
    """The meta.json of the merged checkpoint `folder`; MissingInputError when there is none,
    CheckpointError naming the file and the key of a missing or mistyped field."""
    path = Path(folder) / META
    return records.read(Merged, path, CheckpointError, REMEDY,
                        MissingInputError(f"{path}: no merged checkpoint (run the merge_checkpoint rule first)"))


def write_merged(folder: Path, merged: Merged) -> None:
    data = dataclasses.asdict(merged)
    data["chosen"] = {key: value for key, value in data["chosen"].items() if value is not None}
    records.write_data(Path(folder) / META, data, sort_keys=True)
