"""The layout of a run's training folder (`results/<run>/train/`, the folder the
train rule gives `ortflow train --out`), in one place, as artifacts.py is for the
artifacts: the launcher, the ranks, the merge and report rules all read it here.

    metrics.json   the run's summary and history, written by rank 0 at the end (the rule's output)
    checkpoints/   step-XXXXXXXX/: the sharded checkpoints (checkpoints/layout.py)
    tensorboard/   TensorBoard's event files, written by rank 0
    profile/       ONNX Runtime's profiler traces of train.profile_steps, one pair per rank
    heartbeat/     each rank's last step and phase, read by the collective watchdog (comm.py)
    ready/         a file per rank that listens for stop signals (stop.py), which the launcher waits for
    attempt.lock   held while an attempt runs: a second one is refused
    STOPPED        {"signal", "step"}: the last attempt stopped on a signal, after a checkpoint
    FINISHED       {"steps"}: the last attempt trained to the end
    previous/      a finished run's checkpoints and events, moved aside when a rerun starts anew

Checkpoints and events live beside metrics.json but are not Snakemake outputs:
Snakemake deletes a failed job's outputs, and a rerun resumes from them. STOPPED and FINISHED
are records (records.py), each read and written here only, as ortflow has always written them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import records
from ..errors import TrainingError

REMEDY = "delete it and rerun the train rule"


class TrainFolder:
    """The files of the training folder `folder`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.metrics = self.folder / "metrics.json"
        self.checkpoints = self.folder / "checkpoints"
        self.tensorboard = self.folder / "tensorboard"
        self.profile = self.folder / "profile"
        self.heartbeat = self.folder / "heartbeat"
        self.ready = self.folder / "ready"
        self.lock = self.folder / "attempt.lock"
        self.stopped = self.folder / "STOPPED"
        self.finished = self.folder / "FINISHED"
        self.previous = self.folder / "previous"

    def __str__(self) -> str:
        return str(self.folder)


@dataclasses.dataclass(frozen=True)
class AttemptStopped:
    """STOPPED: rank 0 stopped the run on `signal` (its name: SIGTERM) after the checkpoint of `step`."""

    signal: str
    step: int


def read_stopped(folder: TrainFolder) -> AttemptStopped | None:
    """STOPPED of `folder`, None if the last attempt did not stop on a signal."""
    return records.read(AttemptStopped, folder.stopped, TrainingError, REMEDY) if folder.stopped.is_file() else None


def write_stopped(folder: TrainFolder, stopped: AttemptStopped) -> None:
    records.write(folder.stopped, stopped, end="", indent=None)


@dataclasses.dataclass(frozen=True)
class AttemptFinished:
    """FINISHED: the last attempt trained to the end, `steps` in all."""

    steps: int


def read_finished(folder: TrainFolder) -> AttemptFinished | None:
    """FINISHED of `folder`, None if the last attempt did not train to the end."""
    return records.read(AttemptFinished, folder.finished, TrainingError, REMEDY) if folder.finished.is_file() else None


def write_finished(folder: TrainFolder, finished: AttemptFinished) -> None:
    records.write(folder.finished, finished, indent=None)
