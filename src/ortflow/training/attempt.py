"""One attempt of `ortflow train` on a run's training folder (run_folder.py), from
its start to the exit code it ends with:

- One attempt at a time: a lock on the training folder refuses a second one while
  the first one's ranks live.
- A rerun after a run that finished trains anew: the finished run's checkpoints and
  TensorBoard events are moved to the folder's previous/ first.
- Its end says how it ended (finished, stopped with a checkpoint, failed) in one line
  and in the exit code, and a finished run is noted in FINISHED.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import sys
import time

from ..launcher import ranks_failed
from .run_folder import AttemptFinished, TrainFolder, read_finished, read_stopped, write_finished


def append_to_log() -> None:
    """Write the log (Snakemake's redirection) in append mode: if a later attempt
    empties the file while the ranks of this one still write, their lines go to its
    end instead of leaving a hole of NUL bytes."""
    for fd in (1, 2):
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            pass


def lock_attempt(folder: TrainFolder):
    """The open lock file of the training folder, locked for this attempt, or None
    (said in one line) if another attempt holds it. mpirun inherits the lock, so
    that it stays held while ranks live even if this launcher is killed."""
    folder.folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder.lock, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        print(f"ortflow train: error: another attempt of this run is still training in {folder} "
              f"({lock.read().strip() or 'holder unknown'}); wait for it to end, or stop it, and rerun",
              file=sys.stderr)
        return None
    lock.seek(0)
    lock.truncate()
    lock.write(f"ortflow train pid {os.getpid()} on {socket.gethostname()}, started "
               f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    return lock


def start_attempt(folder: TrainFolder, resume_from: str | None) -> None:
    """Before the ranks start: if the last attempt finished, a rerun trains from step
    0 (unless train.resume_from says where to start), so the finished run's
    checkpoints and TensorBoard events move to the training folder's previous/."""
    if read_finished(folder) and not resume_from and folder.checkpoints.exists():
        previous = TrainFolder(folder.previous)
        shutil.rmtree(previous.folder, ignore_errors=True)
        previous.folder.mkdir()
        for source, target in ((folder.checkpoints, previous.checkpoints), (folder.tensorboard, previous.tensorboard)):
            if source.exists():
                shutil.move(source, target)
        print(f"ortflow train: the previous run in {folder} trained to the end; its checkpoints and TensorBoard "
              f"events are moved to {previous}, and training starts at step 0", file=sys.stderr, flush=True)
    folder.finished.unlink(missing_ok=True)
    folder.stopped.unlink(missing_ok=True)
    # Only this attempt's ranks beat, and say that they are ready.
    for attempt_only in (folder.heartbeat, folder.ready):
        shutil.rmtree(attempt_only, ignore_errors=True)


def end_attempt(folder: TrainFolder, code: int, received: list[signal.Signals], launcher: str, steps: int) -> int:
    """The exit code of `ortflow train` once the MPI launcher `launcher` (its name) exited
    with `code`, after the stop signals `received`, said in one line on stderr; a run
    that trained to the end is noted in FINISHED."""
    stop = read_stopped(folder)
    if stop:  # the ranks stopped on a signal, after writing a checkpoint
        reason = received[0] if received else signal.Signals[stop.signal]
        print(f"ortflow train: stopped by {reason.name} after step {stop.step}, with a checkpoint; "
              "rerun to resume from it", file=sys.stderr)
        return 128 + reason
    if code != 0 and received:
        print(f"ortflow train: error: stopped by {received[0].name}, but the ranks exited with code {code} without "
              "a checkpoint of the step they reached; rerun to resume from the last one", file=sys.stderr)
        return 128 + received[0]
    if code != 0:
        print(f"ortflow train: error: {ranks_failed(code, launcher)}", file=sys.stderr)
        return code
    if received:  # the ranks had agreed on their last step: nothing left to stop
        print(f"ortflow train: {received[0].name} came after the ranks had agreed on their last step; training "
              "finished", file=sys.stderr)
    if not folder.metrics.exists():
        print(f"ortflow train: error: the ranks finished but wrote no {folder.metrics}", file=sys.stderr)
        return 1
    write_finished(folder, AttemptFinished(steps))
    return 0
