"""Starting the ranks of the training loop with the MPI launcher and watching over them
until it exits, from `ortflow train`:

- SIGTERM, SIGINT or SIGUSR1 to `ortflow train` reach the ranks as SIGUSR1 (see
  stop.py), and so does the end of Snakemake or of `ortflow train` itself, even by
  SIGKILL; ranks that have not stopped GRACE_S later are killed.
- A stop is held until every rank listens for it (each says so in the training
  folder's ready/): a Python process dies of a SIGUSR1 that comes before it has a
  handler.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..launcher import launcher_command
from .preflight import host_cores
from .stop import GRACE_S, STOP_SIGNALS


def rank_command(mpi: str, world_size: int, job: dict) -> list[str]:
    """The command that starts `world_size` ranks of the loop with the MPI launcher `mpi`,
    each given `job` ({"config", "train", "eval", "artifacts", "out", "warnings"}: trainer.main's argument)."""
    return launcher_command(shutil.which(mpi) or mpi, world_size, host_cores()) + [
        sys.executable, "-m", "ortflow.training.trainer", json.dumps(job)]


def note_stop_signals() -> list[signal.Signals]:
    """From now on, the stop signals this launcher receives, in order, instead of its end."""
    received: list[signal.Signals] = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: received.append(signal.Signals(signum)))
    return received


def _die_with_parent() -> None:
    """In mpirun, before it starts: SIGUSR1 when this launcher ends, however it ends."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)


class Ranks:
    """The ranks of this attempt that listen for stop signals: each writes a file
    into `ready` once it has its handlers (stop.StopRequest.install)."""

    def __init__(self, ready: Path, world_size: int):
        self.ready, self.world_size = ready, world_size

    def listening(self) -> int:
        return len(list(self.ready.iterdir())) if self.ready.is_dir() else 0

    def all_listen(self) -> bool:
        return self.listening() >= self.world_size


def supervise(command: list[str], env: dict, lock, received: list, ranks: Ranks) -> int:
    """Run the MPI launcher to its end; returns its exit code. A stop signal to this
    launcher (noted in `received`), or the end of the Snakemake that started it,
    reaches the ranks as SIGUSR1 once they all listen for it; the launcher is
    killed GRACE_S after the stop if it has not ended."""
    # A session of its own: a Ctrl-C or a signal to Snakemake's process group
    # reaches this launcher only, which asks the ranks to stop with a checkpoint.
    process = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                               pass_fds=(lock.fileno(),))
    watched, forwarded, deadline = snakemake_chain(), False, None
    while True:
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        gone = next((name for process, name in watched if not _alive(process)), None)
        if gone is not None and not received:
            print(f"ortflow train: {gone}, which started this launcher, exited", file=sys.stderr, flush=True)
            received.append(signal.SIGHUP)
        if received and deadline is None:
            held = "" if ranks.all_listen() else (
                f"; held until every rank listens for it ({ranks.listening()} of {ranks.world_size} do)")
            print(f"ortflow train: {received[0].name}: the ranks finish their step, write a checkpoint and stop "
                  f"(they are killed after {GRACE_S:.0f} s){held}", file=sys.stderr, flush=True)
            deadline = time.monotonic() + GRACE_S
        if received and not forwarded and ranks.all_listen():
            process.send_signal(signal.SIGUSR1)
            forwarded = True
        if deadline is not None and time.monotonic() > deadline:
            print(f"ortflow train: the ranks did not stop within {GRACE_S:.0f} s; killing them", file=sys.stderr,
                  flush=True)
            os.killpg(process.pid, signal.SIGKILL)
            deadline = math.inf


def _alive(process) -> bool:
    """Whether `process` still runs: a killed process whose parent has not yet
    reaped it (a zombie, e.g. Snakemake started by a Python program) does not."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def snakemake_chain() -> list[tuple]:
    """(process, name) of this launcher's ancestors up to the outermost Snakemake
    that started it (the shell of the rule, Snakemake's job process, Snakemake),
    or none if no Snakemake started it: run by hand, the launcher goes on when its
    shell ends (nohup)."""
    import psutil

    chain = [(parent, f"{parent.name()} (pid {parent.pid})") for parent in psutil.Process().parents()[:6]]
    started_by_snakemake = [i for i, (parent, _) in enumerate(chain)
                            if any("snakemake" in Path(arg).name for arg in parent.cmdline()[:2])]
    return chain[:started_by_snakemake[-1] + 1] if started_by_snakemake else []
