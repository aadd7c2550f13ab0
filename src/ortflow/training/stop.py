"""Stopping a run cleanly when it is asked to: preemption, a time limit, Ctrl-C.

SIGTERM, SIGINT or SIGUSR1 to any rank asks the run to stop. A rank only notes
the signal; the all-reduce that already sums each step's loss carries the notes
too (one count per reason), so every rank learns at the same step that some rank
was asked, finishes that step, and the ranks write a checkpoint together, note
the stop in the training folder's STOPPED (run_folder.py) and end; `ortflow train` then exits with
128 + the signal's number. `ortflow train` passes the signals it gets on to
the ranks as SIGUSR1: Open MPI 5's mpirun kills its ranks 0.5 s after a SIGTERM
or SIGINT (SIGCONT, SIGTERM, SIGKILL: measured), but forwards SIGUSR1 untouched.
SIGUSR1 kills a process that has no handler for it yet (a rank still starting
Python), so each rank says when it has one (a file in the training folder's
ready/), and `ortflow train` holds a
stop until every rank does. Once the ranks have agreed on their last step (the
end of train.steps, early stopping, or a stop) there is nothing left to stop,
and each rank ignores the stop signals until it exits (StopRequest.settle).

A rank whose parent (mpirun, or srun's step daemon) went away stops the same
way, as if hung up on (SIGHUP), and ends by itself at the latest GRACE_S later.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# The reasons to stop, in the order of the counts in the all-reduce and of
# precedence when ranks were stopped for different ones.
REASONS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
# From a stop request until the ranks must have written their checkpoint and
# exited; `ortflow train` kills them after that. Slurm sends SIGKILL KillWait
# (default 30 s) after SIGTERM: this leaves 10 s of that for everything else.
GRACE_S = 20.0


class Stopped(Exception):
    """Every rank agreed to stop at `step` for `reason` (a signal) and the checkpoint is written."""

    def __init__(self, reason: signal.Signals, step: int, where):
        super().__init__(f"stopped by {reason.name} after step {step}; checkpoint {where}")
        self.reason, self.step, self.where = reason, step, where


class StopRequest:
    """This rank's note of why it was asked to stop (a signal), if it was."""

    def __init__(self):
        self.reason: signal.Signals | None = None
        self.parent = os.getppid()

    def install(self, ready: Path) -> "StopRequest":
        """Note the stop signals instead of dying of them, watch the parent process,
        and say so with a file in the folder `ready` (the training folder's ready/)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._note)
        threading.Thread(target=self._watch_parent, daemon=True).start()
        ready.mkdir(parents=True, exist_ok=True)
        (ready / f"{socket.gethostname()}-{os.getpid()}").touch()
        return self

    def _note(self, signum, frame) -> None:
        # Only a note: the main thread may be inside ONNX Runtime or MPI.
        self.reason = self.reason or signal.Signals(signum)

    def _watch_parent(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(0.5)
        self.reason = self.reason or signal.SIGHUP
        # Orphaned ranks normally stop at their next step; a rank that cannot
        # (another rank is gone too) must not live on.
        time.sleep(GRACE_S)
        os._exit(128 + signal.SIGHUP)

    def settle(self) -> None:
        """The ranks agreed on their last step: ignore the stop signals from now on.
        Left to Python's exit, the handlers would go back to the signals' default
        action, death, before mpi4py's MPI_Finalize waits for the other ranks: a
        SIGUSR1 that `ortflow train` forwards then killed a rank that was done (and
        mpirun the rest, before rank 0 wrote metrics.json)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    @property
    def orphaned(self) -> bool:
        return os.getppid() != self.parent

    def votes(self) -> list[float]:
        """One count per reason in REASONS, to be summed over ranks."""
        return [1.0 if self.reason == reason else 0.0 for reason in REASONS]


def agreed(votes) -> signal.Signals | None:
    """The reason to stop after summing every rank's `votes`, or None to go on."""
    return next((reason for reason, count in zip(REASONS, votes) if count > 0), None)


def describe(votes) -> str:
    """`SIGTERM on 1 rank`, from the summed votes."""
    return ", ".join(f"{'parent process exited (SIGHUP)' if reason == signal.SIGHUP else reason.name} "
                     f"on {int(count)} rank{'s' if count != 1 else ''}"
                     for reason, count in zip(REASONS, votes) if count > 0)
