"""Which checkpoint a rerun goes on from (ortflow.checkpoints.resume), on real checkpoint
folders written without MPI: damaged or too new ones are skipped, naming the file. The
same through real mpirun and Snakemake is in test_checkpoint.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from ortflow.digests import digest
from ortflow.checkpoints import layout, resume, writer
from ortflow.checkpoints.ort_format import CheckpointError, TrainingState

IDENTITY = {"seed": 1}
DIGEST = digest(IDENTITY)


class _OneRank:
    rank, world_size = 0, 1

    def allgather(self, value):
        return [value]


def _save(root: Path, step: int, history: dict | None = None) -> Path:
    """A real checkpoint folder of one small parameter, written by writer.save on one rank."""
    weight = np.arange(6, dtype=np.float32).reshape(2, 3) + step
    state = TrainingState({"w": weight}, {"w": True}, {"w": {"momentum0": weight * 0, "momentum1": weight * 0}},
                          {"group_name": "g", "step": step, "initial_learning_rate": 0.1}, {})
    return writer.save(root, step, state.part(layout.partition(state, 1)[0]), _OneRank(), IDENTITY, DIGEST, {"step": step}, keep=10,
                           history=history or {"train": [{"step": step}], "eval": []})


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["checksum", "truncated manifest", "missing shard", "damaged history"])
def test_a_damaged_newest_checkpoint_is_skipped_naming_the_file(tmp_path, monkeypatch, caplog, damage):
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        _save(root, step)
    newest = root / "step-00000020"
    shard, manifest = newest / "shard-00000-of-00001.h5", newest / "manifest.json"
    if damage == "checksum":
        _flip_byte(shard)
        reason = f"shard {shard}: checksum mismatch"
    elif damage == "truncated manifest":
        manifest.write_text(manifest.read_text()[:100])
        reason = f"{manifest}: not readable as JSON"
    elif damage == "missing shard":
        shard.unlink()
        reason = f"shard {shard} is missing"
    else:
        _flip_byte(newest / "history.json")
        reason = f"history file {newest / 'history.json'}: checksum mismatch"
    with caplog.at_level(logging.WARNING, logger="ortflow.checkpoint"):
        found = resume.find_resume(root, IDENTITY, DIGEST, None, steps=100)
    assert found.path == root / "step-00000010"
    assert resume.read_history(found) == {"train": [{"step": 10}], "eval": []}
    assert f"skipping {reason}" in caplog.text
    # Named explicitly, a damaged checkpoint is refused, naming the file.
    with pytest.raises(CheckpointError, match=reason.split(":")[0].split(" is")[0]):
        resume.find_resume(root, IDENTITY, DIGEST, str(newest), steps=100)


def test_a_checkpoint_beyond_train_steps_is_not_used(tmp_path, monkeypatch, caplog):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        _save(root, step)
    with caplog.at_level(logging.INFO, logger="ortflow.checkpoint"):
        assert resume.find_resume(root, IDENTITY, DIGEST, None, steps=25).step == 20
    assert "skipping checkpoint " + str(root / "step-00000030") + ": step 30 is beyond train.steps 25" in caplog.text
    with pytest.raises(CheckpointError, match="step 30 is beyond train.steps 25"):
        resume.find_resume(root, IDENTITY, DIGEST, str(root / "step-00000030"), steps=25)
    assert resume.find_resume(root, {"seed": 2}, digest({"seed": 2}), None, steps=100) is None



def test_a_resharded_checkpoint_keeps_its_history(tmp_path):
    """`ortflow checkpoint reshard` copies history.json (checksummed in the new
    manifest), so that a run resumed from the copy reports the metrics logged before it."""
    from ortflow.checkpoints.reshard import reshard

    history = {"train": [{"step": s, "loss": 1.0 / s} for s in (5, 10)], "eval": [{"step": 10, "loss": 0.4}]}
    source = _save(tmp_path / "checkpoints", 10, history)
    copy = reshard(source, tmp_path / "three", 3)
    manifest = json.loads((copy / layout.MANIFEST).read_text())
    assert manifest["world_size"] == 3 and manifest["history"]["file"] == layout.HISTORY
    found = resume.find_resume(tmp_path, IDENTITY, DIGEST, str(copy), steps=100)
    assert (found.step, resume.read_history(found)) == (10, history)
