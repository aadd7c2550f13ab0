"""`ortflow train`: check the setup, then start `train.world_size` ranks of the
training loop with the MPI launcher (mpirun locally, srun inside a Slurm job),
and watch over them:

- One attempt at a time: a lock on the run's train/ folder refuses a second one.
- A rerun after a run that finished trains anew: the finished run's checkpoints
  and TensorBoard events are moved to train/previous/ first.
- SIGTERM, SIGINT or SIGUSR1 reach the ranks as SIGUSR1 (see stop.py), and so
  does the end of Snakemake or of this launcher, even by SIGKILL; ranks that
  have not stopped GRACE_S later are killed. A stop is held until every rank
  listens for it (each says so in train/ready/): a Python process dies of a
  SIGUSR1 that comes before it has a handler. One that comes before the ranks
  start ends the attempt there; one that comes after the ranks agreed on their
  last step leaves a finished run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .. import atomic, config as config_mod
from ..artifacts import Artifacts
from ..graphs import pipeline
from ..launcher import launcher_command, launcher_env
from ..training.preflight import host_cores, preflight, raise_if_problems
from ..training.run_folder import TrainFolder
from ..training.stop import GRACE_S, STOP_SIGNALS

HELP = "train the artifacts on the shards with W ranks (mpirun or srun)"

def add_arguments(parser) -> None:
    config_mod.add_config_arguments(parser)
    parser.add_argument("--mpi", default="mpirun", help="MPI launcher: mpirun, mpiexec or srun")
    parser.add_argument("-n", "--world-size", type=int, help="ranks (default: train.world_size)")
    parser.add_argument("--train", required=True, type=Path, help="folder of the train split's shards")
    parser.add_argument("--eval", required=True, type=Path, help="folder of the eval split's shards")
    parser.add_argument("--artifacts", required=True, type=Path)
    parser.add_argument("--out", required=True, type=TrainFolder,
                        help="the training folder (results/<run>/train): checkpoints, metrics.json, TensorBoard events")


def run(args) -> int:
    received = note_stop_signals()
    config = config_mod.load_config(args)
    if args.world_size:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, world_size=args.world_size))
    world_size = config.train.world_size
    # Cheap checks first: a missing launcher or GPU is reported with its fix
    # in a second, rather than as a hang or a traceback from inside a rank.
    folder = args.out
    model = Artifacts(args.artifacts)
    check_stages(model, config.train.pipeline_stages)
    # Without model.json the ranks stop at once, naming the missing artifacts.
    description = model.description() if model.model_json.is_file() else None
    raise_if_problems(preflight(config, args.mpi, folder.folder.parent, description, pipeline.held_by_stages(model)))
    append_to_log()
    lock = lock_attempt(folder)
    if lock is None:
        return 1
    start_attempt(folder, config.train.resume_from)
    if received:
        print(f"ortflow train: stopped by {received[0].name} before the ranks started; rerun to train",
              file=sys.stderr)
        return 128 + received[0]
    mpi = shutil.which(args.mpi) or args.mpi
    command = launcher_command(mpi, world_size, host_cores()) + [
        sys.executable, "-m", "ortflow.training.trainer",
        json.dumps({"config": config_mod.as_dict(config), "train": str(args.train), "eval": str(args.eval),
                    "artifacts": str(args.artifacts), "out": str(folder)}),
    ]
    print(f"ortflow train: {' '.join(command[:command.index(sys.executable)])} ...", file=sys.stderr, flush=True)
    code = supervise(command, launcher_env(os.environ), lock, received, Ranks(folder.ready, world_size))
    if folder.stopped.exists():  # the ranks stopped on a signal, after writing a checkpoint
        stop = json.loads(folder.stopped.read_text())
        reason = received[0] if received else signal.Signals[stop["signal"]]
        print(f"ortflow train: stopped by {reason.name} after step {stop['step']}, with a checkpoint; "
              "rerun to resume from it", file=sys.stderr)
        return 128 + reason
    if code != 0 and received:
        print(f"ortflow train: error: stopped by {received[0].name}, but the ranks exited with code {code} without "
              "a checkpoint of the step they reached; rerun to resume from the last one", file=sys.stderr)
        return 128 + received[0]
    if code != 0:
        print(f"ortflow train: error: {ranks_failed(code, Path(args.mpi).name)}", file=sys.stderr)
        return code
    if received:  # the ranks had agreed on their last step: nothing left to stop
        print(f"ortflow train: {received[0].name} came after the ranks had agreed on their last step; training "
              "finished", file=sys.stderr)
    if not folder.metrics.exists():
        print(f"ortflow train: error: the ranks finished but wrote no {folder.metrics}", file=sys.stderr)
        return 1
    atomic.write_text(folder.finished, json.dumps({"steps": config.train.steps}) + "\n")
    return 0


def check_stages(artifacts: Artifacts, stages: int) -> None:
    """With train.pipeline_stages P > 1, the artifacts are cut into P stages (their pipeline.json).
    Any artifacts hold the whole model's graphs, which a run with P = 1 trains."""
    if stages == 1 or not artifacts.model_json.is_file():  # without model.json the ranks name what is missing
        return
    built = len(json.loads(artifacts.pipeline_json.read_text())["stages"]) if artifacts.pipeline_json.is_file() else 1
    if built != stages:
        raise config_mod.ConfigError(
            f"config key 'train.pipeline_stages': {stages} stages, but the artifacts {artifacts.folder} are cut into "
            f"{built} ({artifacts.pipeline_json.name}); rebuild them with train.pipeline_stages: {stages}, or set "
            f"train.pipeline_stages: {built}")


def note_stop_signals() -> list[signal.Signals]:
    """From now on, the stop signals this launcher receives, in order, instead of its end."""
    received: list[signal.Signals] = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: received.append(signal.Signals(signum)))
    return received


def ranks_failed(code: int, launcher: str) -> str:
    """What the MPI launcher's exit code says. A rank that failed wrote its error above;
    one killed by a signal (code 128 + its number) wrote nothing, and only the
    launcher's own message names it."""
    killer = next((signum for signum in signal.Signals if code == 128 + signum), None)
    if killer is None:
        return f"the ranks exited with code {code}; the failing rank's error is above"
    oom = " (the kernel's out-of-memory killer sends it: see `dmesg`)" if killer == signal.SIGKILL else ""
    return (f"the ranks exited with code {code}: a rank was killed by {killer.name}{oom}; {launcher}'s message "
            "above names it")


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
    if folder.finished.exists() and not resume_from and folder.checkpoints.exists():
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
