"""A full disk, a folder without write permission and a read-only file system, for
real: a small tmpfs mounted by the test (needs root, as CI runs; skipped where
mounting is not permitted) and a process without the capability that lets root
write anywhere. Each gives one line naming the path and what to do, and leaves
no checkpoint that looks complete and every earlier one intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortflow import storage
from ortflow.checkpoints import layout, reader, resume, writer
from ortflow.checkpoints.ort_format import TrainingState

BIN = Path(sys.executable).parent
IDENTITY = {"optimizer": {"name": "adamw"}}
DIGEST = "e" * 64


class OneRank:
    rank, world_size = 0, 1

    def allgather(self, value):
        return [value]


@pytest.fixture
def mount(tmp_path):
    """Mounts a tmpfs of the given size at a fresh folder; unmounts it afterwards."""
    mounted = []

    def make(size: str) -> Path:
        folder = tmp_path / f"disk-{len(mounted)}"
        folder.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def state_of(megabytes: float):
    """A one-rank checkpoint shard of about `megabytes`."""
    n = int(megabytes * 1e6 / 12)  # a parameter and two AdamW moments of float32
    rng = np.random.default_rng(0)
    w = rng.normal(size=n).astype(np.float32)
    state = TrainingState({"w": w}, {"w": True}, {"w": {"momentum0": w * 0, "momentum1": w * 0}},
                          {"group_name": "group0", "step": 1, "initial_learning_rate": 0.1}, {"step": 1})
    return state.part(layout.partition(state, 1)[0])


def save(root: Path, step: int, state) -> Path:
    return writer.save(root, step, state, OneRank(), IDENTITY, DIGEST, {"step": step, "lr": 0.1}, keep=2)


def test_full_disk_then_read_only_while_checkpointing(mount):
    root = mount("1m") / "checkpoints"
    state = state_of(0.6)
    first = save(root, 10, state)
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    with pytest.raises(OSError) as error:  # the second checkpoint does not fit
        save(root, 20, state)
    line = storage.explain(error.value)
    shard = root / "step-00000020" / "shard-00000-of-00001.h5.tmp"
    assert line.startswith(f"cannot write {shard}: no space left on device (")
    assert f"MB free in {shard.parent}); free space on that file system, or run where there is more" in line
    assert sorted(p.name for p in (root / "step-00000020").iterdir()) == []  # nothing half-written, no COMPLETE
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert resume.latest(root, DIGEST).step == 10
    reader.read_checkpoint(first)

    subprocess.run(["mount", "-o", "remount,ro", str(root.parent)], check=True)
    with pytest.raises(OSError) as error:
        save(root, 30, state)
    assert storage.explain(error.value) == (
        f"cannot write {root / 'step-00000030'}: the file system is read-only; run the workflow in a writable "
        "folder (snakemake --directory DIR), or remount it read-write")
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before


def ortflow(*args: str, drop_root_override: bool = False) -> subprocess.CompletedProcess:
    """The `ortflow` command; with `drop_root_override`, without the capabilities that let
    root write into any folder (so that permissions count for root too)."""
    command = [str(BIN / "ortflow"), *args]
    if drop_root_override and os.geteuid() == 0:
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def prepare_data(out: Path, **kwargs) -> subprocess.CompletedProcess:
    config = json.dumps({"run": {"seed": 1}, "data": {"source": "digits"}})
    return ortflow("prepare-data", "--config-json", config, "--train", str(out / "train"), "--eval",
                   str(out / "eval"), **kwargs)


def test_prepare_data_on_a_full_disk(mount):
    out = mount("128k")  # each of the two shards of the digits train split takes 190 kB
    result = prepare_data(out)
    assert result.returncode == 1
    line = f"ortflow prepare-data: error: cannot write {out / 'train.tmp' / 'shard-00000.bin'}: no space left on device"
    assert result.stderr.startswith(line) and len(result.stderr.splitlines()) == 1, result.stderr
    assert list(out.iterdir()) == []  # the unfinished split is removed


def test_permission_denied(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    out.chmod(0o555)
    try:
        result = prepare_data(out, drop_root_override=True)
    finally:
        out.chmod(0o755)
    assert result.returncode == 1
    user = __import__("getpass").getuser()
    assert result.stderr == (f"ortflow prepare-data: error: cannot write {out / 'train.tmp'}: permission denied; make "
                             f"{out} writable for user {user}, or run the workflow in a folder of your own "
                             "(snakemake --directory DIR)\n"), result.stderr
