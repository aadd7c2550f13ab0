"""The sharded checkpoint format's arithmetic, without a run: how a checkpoint's bytes
are split over ranks, and which checkpoints are pruned. Through real runs: test_checkpoint.py."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.checkpoints import layout, retention
from ortflow.checkpoints.layout import Manifest
from ortflow.checkpoints.manifest import write_manifest
from ortflow.checkpoints.ort_format import TrainingState


def state(sizes: dict[str, int], moments: int = 2) -> TrainingState:
    """Parameters of `sizes` float32 elements, each with `moments` AdamW-like moments."""
    params = {name: np.arange(n, dtype=np.float32) for name, n in sizes.items()}
    return TrainingState(params, {n: True for n in params},
                         {n: {f"momentum{i}": p + i + 1 for i in range(moments)} for n, p in params.items()},
                         {"step": 1}, {})


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_partition_covers_every_element_once_in_nearly_equal_bytes(world_size):
    full = state({"b": 5, "a": 1000, "c": 1, "d": 0, "e": 37})
    parts = layout.partition(full, world_size)
    assert len(parts) == world_size
    for name, array in full.parameters.items():
        ranges = sorted(part[name] for part in parts if name in part)
        covered = [i for start, stop in ranges for i in range(start, stop)]
        assert covered == list(range(array.size)), (name, ranges)
    per_rank = [sum((stop - start) * 4 * 3 for start, stop in part.values()) for part in parts]
    total = sum(full.nbytes(n) for n in full.parameters)
    assert sum(per_rank) == total
    assert max(per_rank) - min(per_rank) <= 4 * 3  # at most one element (with its two moments) apart


def test_partition_splits_one_large_parameter_across_ranks():
    parts = layout.partition(state({"big": 10, "small": 2}), 3)
    assert [part.get("big") for part in parts] == [(0, 4), (4, 8), (8, 10)]
    assert [part.get("small") for part in parts] == [None, None, (0, 2)]


def _checkpoint(root, step: int, digest: str, complete: bool = True):
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    write_manifest(folder / layout.MANIFEST, Manifest(f"{step}-x", step, 1, {}, digest, {}, ()))
    if complete:
        (folder / layout.COMPLETE).write_text("")
    return folder


def test_pruning_keeps_the_newest_of_this_identity_and_leaves_others_alone(tmp_path):
    ours = [_checkpoint(tmp_path, s, "ours") for s in (10, 20, 30, 40)]
    other = _checkpoint(tmp_path, 25, "other")
    crashed_old = _checkpoint(tmp_path, 15, "ours", complete=False)
    crashed_new = _checkpoint(tmp_path, 50, "ours", complete=False)
    retention.prune(tmp_path, "ours", keep=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(p.name for p in (ours[2], ours[3], other, crashed_new)), left
    assert not crashed_old.exists()


