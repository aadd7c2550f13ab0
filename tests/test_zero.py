"""ZeRO-1 (train.zero 1) on real MPI ranks: the tiny GPT trained 50 steps at W=2
with its optimizer state sharded equals the unsharded run within 1e-6; its
checkpoints, whose shards are what each rank owned, resume at W=2 bit for bit,
at W=1 and W=3 and without ZeRO, and still merge and reshard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import require_e2e
from ortflow import config as config_mod, launcher
from ortflow.checkpoints import layout, reader
from ortflow.checkpoints.merge import merge
from ortflow.checkpoints.reshard import reshard
import test_weight_decay as tiny_gpt
from test_weight_decay import settings

GLOBAL_BATCH = 12

built, train_dir = tiny_gpt.built, tiny_gpt.train_dir  # the fixtures of the tiny GPT's data and artifacts


def run_ranks(folder: Path, artifacts: Path, data: Path, ranks: int, zero: int, steps: int,
              resume_from: Path | None = None) -> Path:
    """`ortflow train`'s rank program (training/trainer.py) on `ranks` MPI ranks; the training folder."""
    require_e2e("starts MPI ranks")
    config = settings(world_size=ranks, zero=zero, steps=steps, micro_batch_size=GLOBAL_BATCH // ranks,
                      lr_schedule={"name": "constant"}, checkpoint_every=50, keep_checkpoints=5, eval_every=1000,
                      resume_from=str(resume_from) if resume_from else None)
    job = {"config": config_mod.as_dict(config), "train": str(data), "eval": str(data.parent / "eval"), "artifacts": str(artifacts),
           "out": str(folder), "warnings": []}
    result = subprocess.run(launcher.launcher_command("mpirun", ranks, 2)
                            + [sys.executable, "-m", "ortflow.training.trainer", json.dumps(job)],
                            env=launcher.launcher_env(os.environ), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "checkpoints"


def parameters(checkpoint: Path) -> dict:
    return reader.read_checkpoint(checkpoint).state.parameters


def largest_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[name] - b[name]).max()) for name in a)


@pytest.mark.e2e
def test_zero_1_equals_the_unsharded_run_and_its_checkpoints_resume_anywhere(built, train_dir, tmp_path):
    artifacts = built["adamw"][0]
    unsharded = run_ranks(tmp_path / "zero0", artifacts, train_dir, 2, 0, 50)
    sharded = run_ranks(tmp_path / "zero1", artifacts, train_dir, 2, 1, 55)
    at_50 = sharded / "step-00000050"
    worst = largest_difference(parameters(unsharded / "step-00000050"), parameters(at_50))
    print(f"ZeRO-1 against the unsharded run after 50 steps at W=2: largest difference {worst:.3g}")
    assert worst < 1e-6

    # The shards are what each rank owned: rank 0's holds momentum0 and momentum1 of a part of the parameters only.
    whole = reader.read_checkpoint(at_50).state
    for rank in range(2):
        _, part = reader.read_shard(at_50 / layout.shard_name(rank, 2))
        assert part.parameters.keys() == layout.partition(whole, 2)[rank].keys()
        assert all(set(moments) == {"momentum0", "momentum1"} for moments in part.optimizer_states.values())
    assert whole.optimizer["step"] == 50

    uninterrupted = parameters(sharded / "step-00000055")
    for ranks, zero, tolerance in ((2, 1, 0.0), (2, 0, 1e-6), (1, 0, 1e-5), (3, 1, 1e-5)):
        resumed = run_ranks(tmp_path / f"resumed-{ranks}-{zero}", artifacts, train_dir, ranks, zero, 55, at_50)
        difference = largest_difference(parameters(resumed / "step-00000055"), uninterrupted)
        print(f"resumed at W={ranks} zero {zero}: largest difference to the uninterrupted run {difference:.3g}")
        assert difference <= tolerance, (ranks, zero)

    merged = merge(sharded, tmp_path / "merged", model=artifacts)
    assert largest_difference(reader.load_parameters_file(merged / "checkpoint"), uninterrupted) == 0.0
    resharded = reshard(sharded / "step-00000055", tmp_path / "resharded", 3, model=artifacts)
    assert largest_difference(parameters(resharded), uninterrupted) == 0.0
