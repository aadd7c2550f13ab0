"""The MPI launcher that starts the ranks: its command line (mpirun or mpiexec
locally, srun inside a Slurm allocation), the ranks' environment, and what its
exit code says."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from .errors import ConfigError


# Open MPI refuses to start as root (containers and CI often run as root) unless both are set.
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def launcher_command(mpi: str, world_size: int, cores: int) -> list[str]:
    """The command that starts `world_size` copies of the loop."""
    name = Path(mpi).name
    if name == "srun":
        # Inside a Slurm allocation; PMIx is how OpenMPI 5 ranks find each other under srun.
        return [mpi, "--mpi=pmix", "-n", str(world_size)]
    if name == "mpirun" or name == "mpiexec":
        command = [mpi, "-n", str(world_size), "--bind-to", "none"]
        if world_size > cores:
            command.append("--oversubscribe")
        return command
    raise ConfigError(f"resources.mpi: unknown MPI launcher {mpi!r}; expected mpirun, mpiexec or srun")


def launcher_env(environ: dict) -> dict:
    """The ranks' environment: `environ`, with ROOT_ENV where we run as root."""
    env = dict(environ)
    if os.geteuid() == 0:
        for key, value in ROOT_ENV.items():
            env.setdefault(key, value)
    return env


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
