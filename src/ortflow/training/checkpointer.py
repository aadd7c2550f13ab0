"""When the ranks write a checkpoint together, and which one a run goes on from."""

from __future__ import annotations

from pathlib import Path

from .. import config as config_mod
from ..checkpoints import best, layout, resume, writer
from ..checkpoints.ort_format import TrainingState
from ..digests import digest
from .gradients import on_host, parameters
from .run_summary import strict
from .schedule import is_time


class Checkpointer:
    """Decides when the ranks write a checkpoint together (`should_save`), and writes it."""

    def __init__(self, root: Path, comm, config: config_mod.Config):
        train = config.train
        self.root, self.comm = root, comm
        self.identity = config_mod.training_identity(config)
        self.identity_digest = digest(self.identity)
        self.every, self.steps, self.keep = train.checkpoint_every, train.steps, train.keep_checkpoints
        self.global_batch = config_mod.global_batch_size(config)
        self.last: tuple[int, Path] | None = None  # (step, folder) of the newest one written

    def should_save(self, done: int, stop, new_best: bool, exhausted: bool) -> bool:
        """Whether the ranks write a checkpoint after `done` steps: every `train.checkpoint_every`
        steps and after the last one, when they agreed to stop (`stop`: the signal, or None),
        when its evaluation is the best so far and kept for the export (`new_best`), and when
        early stopping ends the run (`exhausted`). Every rank decides the same from the same values."""
        return is_time(done, self.every, self.steps) or stop is not None or new_best or exhausted

    def find_resume(self, resume_from: str | None, artifacts: Path) -> resume.Resume | None:
        """The checkpoint to go on from (see checkpoints/resume.py), or None to start at step 0."""
        return resume.find_resume(self.root, self.identity, self.identity_digest, resume_from, self.steps, artifacts)

    def save(self, done: int, part, lr: float, history: dict) -> Path:
        """The checkpoint after `done` steps (written once, however often it is asked for);
        `part()` gives this rank's shard of it (`live_part`)."""
        if self.last and self.last[0] == done:
            return self.last[1]
        self.comm.watchdog.beat(done - 1, "checkpoint")
        properties = {"step": done, "lr": lr, "samples_seen": done * self.global_batch}
        folder = writer.save(self.root, done, part(), self.comm, self.identity, self.identity_digest, properties,
                            self.keep, strict(history))
        self.last = (done, folder)
        return folder

    def mark_best(self, done: int, record: dict) -> None:
        """The checkpoint after `done` steps (written) is the best so far, by `record`."""
        if self.comm.rank == 0:
            best.mark_best(self.root, layout.step_dir(self.root, done), self.identity_digest, record)


def live_part(state, slices: dict[str, tuple[int, int]], trainable: set[str], optimizer, xp) -> TrainingState:
    """This rank's shard of a checkpoint, straight from the arrays it trains on: its
    `slices` (layout.partition's) of every parameter, views of ORT's live buffers (copied
    to the host from a GPU), and of the moments of the `trainable` ones, which
    `optimizer` holds (under train.zero 1, exactly the slices it owns)."""
    names = list(slices)
    live = dict(zip(names, parameters(state, names, xp)))
    return TrainingState(
        {name: on_host(live[name].reshape(-1)[slice(*slices[name])], xp) for name in names},
        {name: name in trainable for name in names},
        {name: optimizer.moments_of(name, *slices[name]) for name in names if name in trainable},
        optimizer.attributes(), {}, slices={name: (tuple(live[name].shape), slices[name][0]) for name in names})
