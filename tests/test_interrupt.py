"""Interrupted runs without MPI (fast): the stop rule, which checkpoint a rerun goes on
from, the training identity, strict metrics, and what the launcher does before the
ranks start. The same through real mpirun and Snakemake is in test_checkpoint.py;
here, through real mpirun, a stop that reaches the launcher before its ranks listen
for it, or after their last step."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ortflow import config as config_mod
from ortflow.checkpoints import resume, store
from ortflow.checkpoints.ort_format import CheckpointError, TrainingState
from ortflow import train
from ortflow.training import stop
from ortflow.training.trainer import is_time
from ortflow.training.metrics import strict

IDENTITY = {"seed": 1}
DIGEST = config_mod.digest(IDENTITY)


def test_stop_votes_ride_with_the_loss_and_agree_on_one_reason():
    assert stop.agreed([0.0, 0.0, 0.0, 0.0]) is None
    request = stop.StopRequest()
    assert request.votes() == [0.0, 0.0, 0.0, 0.0]
    request._note(signal.SIGUSR1, None)
    request._note(signal.SIGTERM, None)  # the first signal is the reason
    other = [0.0, 0.0, 0.0, 1.0]  # another rank lost its parent
    summed = np.add(request.votes(), other)
    assert stop.agreed(summed) == signal.SIGUSR1
    assert stop.describe(summed) == "SIGUSR1 on 1 rank, parent process exited (SIGHUP) on 1 rank"
    assert stop.agreed(np.add(summed, [2.0, 0.0, 0.0, 0.0])) == signal.SIGTERM


def test_is_time_every_period_and_at_the_end():
    assert [d for d in range(1, 26) if is_time(d, 10, 25)] == [10, 20, 25]


class _OneRank:
    rank, world_size = 0, 1

    def allgather(self, value):
        return [value]


def _save(root: Path, step: int, monkeypatch, history: dict | None = None) -> Path:
    """A real checkpoint folder of one small parameter, written by store.save on one rank."""
    monkeypatch.setattr(store, "training_state", lambda state: state)
    weight = np.arange(6, dtype=np.float32).reshape(2, 3) + step
    state = TrainingState({"w": weight}, {"w": True}, {"w": {"momentum0": weight * 0, "momentum1": weight * 0}},
                          {"group_name": "g", "step": step, "initial_learning_rate": 0.1}, {})
    return store.save(root, step, state, _OneRank(), IDENTITY, DIGEST, {"step": step}, keep=10,
                           history=history or {"train": [{"step": step}], "eval": []})


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["checksum", "truncated manifest", "missing shard", "damaged history"])
def test_a_damaged_newest_checkpoint_is_skipped_naming_the_file(tmp_path, monkeypatch, caplog, damage):
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        _save(root, step, monkeypatch)
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
        _save(root, step, monkeypatch)
    with caplog.at_level(logging.INFO, logger="ortflow.checkpoint"):
        assert resume.find_resume(root, IDENTITY, DIGEST, None, steps=25).step == 20
    assert "skipping checkpoint " + str(root / "step-00000030") + ": step 30 is beyond train.steps 25" in caplog.text
    with pytest.raises(CheckpointError, match="step 30 is beyond train.steps 25"):
        resume.find_resume(root, IDENTITY, DIGEST, str(root / "step-00000030"), steps=25)
    assert resume.find_resume(root, {"seed": 2}, config_mod.digest({"seed": 2}), None, steps=100) is None


def test_identity_has_the_steps_where_the_schedule_spreads_over_them():
    def digest(**train):
        return config_mod.digest(config_mod.training_identity(config_mod.load(overrides={"train": train})))

    assert digest(steps=300) != digest(steps=200)  # cosine by default
    constant = {"name": "constant", "warmup_steps": 20}
    assert digest(steps=300, lr_schedule=constant) == digest(steps=200, lr_schedule=constant)


def test_identity_knows_user_files_by_content_not_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.onnx").write_bytes(b"model one")
    (tmp_path / "b.onnx").write_bytes(b"model one")
    (tmp_path / "data.csv").write_text("x,y\n1,2\n")

    def identity(model_path: str) -> dict:
        config = config_mod.load(overrides={"model": {"kind": "onnx", "path": model_path},
                                            "data": {"source": "data.csv"}})
        return config_mod.training_identity(config)

    first = identity("a.onnx")
    assert first == identity("b.onnx")  # moved or copied: the same model
    assert first["data"]["source"].startswith("sha256:")
    (tmp_path / "a.onnx").write_bytes(b"model two")  # replaced in place
    assert resume._differences(first, identity("a.onnx")) == [
        f"model.path: {first['model']['path']!r} in the checkpoint, {identity('a.onnx')['model']['path']!r} now"]


def test_metrics_are_strict_json():
    summary = strict({"samples_per_s": float("nan"), "eval": {"loss": float("inf")}, "history": [1.5]})
    assert summary == {"samples_per_s": None, "eval": {"loss": None}, "history": [1.5]}
    json.dumps(summary, allow_nan=False)


def test_rerun_after_a_finished_run_moves_its_checkpoints_aside(tmp_path, capsys):
    out = tmp_path / "train"
    (out / "checkpoints" / "step-00000300").mkdir(parents=True)
    (out / "tensorboard").mkdir()
    (out / "heartbeat").mkdir()
    (out / train.FINISHED).write_text("{}")
    train.start_attempt(out, out / "checkpoints", resume_from=None)
    assert (out / "previous/checkpoints/step-00000300").is_dir() and (out / "previous/tensorboard").is_dir()
    assert not (out / "checkpoints").exists() and not (out / train.FINISHED).exists()
    assert not (out / "heartbeat").exists()
    assert f"its checkpoints and TensorBoard events are moved to {out / 'previous'}" in capsys.readouterr().err
    # After an interrupted run, or with train.resume_from, nothing moves.
    (out / "checkpoints").mkdir()
    train.start_attempt(out, out / "checkpoints", resume_from=None)
    (out / train.FINISHED).write_text("{}")
    train.start_attempt(out, out / "checkpoints", resume_from=str(out / "checkpoints"))
    assert (out / "checkpoints").is_dir() and not (out / train.FINISHED).exists()


def test_a_second_live_attempt_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "train"
    first = train.lock_attempt(out)
    assert first is not None
    assert train.lock_attempt(out) is None
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert f"ortflow train: error: another attempt of this run is still training in {out} (ortflow train pid" in error
    first.close()
    assert train.lock_attempt(out) is not None


# Imported by every Python process that has it on its PYTHONPATH (site's
# sitecustomize); slows down only the ranks that mpirun starts.
SLOW_RANKS = """
import atexit, os, time

if "OMPI_COMM_WORLD_RANK" in os.environ:
    time.sleep(float(os.environ["SLOW_RANKS_START_S"]))
    atexit.register(time.sleep, float(os.environ["SLOW_RANKS_END_S"]))
"""


def launch(workdir: Path, out: Path, start_s: float = 0, end_s: float = 0) -> subprocess.Popen:
    """`ortflow train` of 40 steps on the default run's data and artifacts in `workdir`,
    into `out`, its ranks `start_s` seconds late to start Python and `end_s` to exit."""
    site = out.parent / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SLOW_RANKS)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
                        "SLOW_RANKS_START_S": str(start_s), "SLOW_RANKS_END_S": str(end_s)}
    config = config_mod.load(overrides={"train": {"steps": 40, "eval_every": 40}})
    results = workdir / "results/digits"
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "ortflow"), "train", "--config-json", json.dumps(config),
         "--train", str(results / "data/train"), "--eval", str(results / "data/eval"),
         "--artifacts", str(results / "artifacts"), "--out", str(out)],
        env=env, stderr=subprocess.PIPE, text=True)


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)


def test_a_stop_before_the_ranks_listen_is_held_until_they_do(digits_inputs, tmp_path):
    """A SIGUSR1 kills a rank that is still starting Python: the launcher forwards the
    stop once every rank has its handler, and the ranks stop after their first step."""
    import psutil

    out = tmp_path / "train"
    launcher = launch(digits_inputs, out, start_s=3)
    wait_for(lambda: psutil.Process(launcher.pid).children(), "started mpirun")
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "ortflow train: SIGTERM: the ranks finish their step, write a checkpoint and stop (they are killed after " \
           "20 s); held until every rank listens for it (0 of 2 do)" in stderr
    assert "stopping after step 1 of 40: SIGUSR1 on 2 ranks" in stderr
    assert "ortflow train: stopped by SIGTERM after step 1, with a checkpoint; rerun to resume from it" in stderr
    assert resume.latest(out / "checkpoints").step == 1


def test_a_stop_after_the_last_step_leaves_a_finished_run(digits_inputs, tmp_path):
    out = tmp_path / "train"
    launcher = launch(digits_inputs, out, end_s=3)
    wait_for(lambda: (out / "metrics.json").exists(), "wrote metrics.json")  # after the last step
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, stderr
    assert "ortflow train: SIGTERM came after the ranks had agreed on their last step; training finished" in stderr
    assert json.loads((out / train.FINISHED).read_text()) == {"steps": 40}
