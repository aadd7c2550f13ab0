"""The MPI launcher that starts the ranks: its command line (mpirun or mpiexec
locally, srun inside a Slurm allocation) and the ranks' environment."""

from __future__ import annotations

import os
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
