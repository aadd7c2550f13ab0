"""`ortflow train`: check the setup, then start `train.world_size` ranks of the
training loop with the MPI launcher (mpirun locally, srun inside a Slurm job)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .. import config as config_mod
from ..errors import ConfigError
from ..preflight import host_cores, preflight, raise_if_problems

HELP = "train the artifacts on the shards with W ranks (mpirun or srun)"

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


def add_arguments(parser) -> None:
    config_mod.add_config_arguments(parser)
    parser.add_argument("--mpi", default="mpirun", help="MPI launcher: mpirun, mpiexec or srun")
    parser.add_argument("-n", "--world-size", type=int, help="ranks (default: train.world_size)")
    parser.add_argument("--data", required=True, type=Path, help="folder with the train/ and eval/ shards")
    parser.add_argument("--artifacts", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="the run's train/ folder")
    parser.add_argument("--metrics", type=Path, help="check that the ranks wrote this file")


def run(args) -> int:
    import json

    config = config_mod.load_config(args)
    if args.world_size:
        config["train"]["world_size"] = args.world_size
    world_size = config["train"]["world_size"]
    # Cheap checks first: a missing launcher or GPU is reported with its fix
    # in a second, rather than as a hang or a traceback from inside a rank.
    raise_if_problems(preflight(config, args.mpi, args.out.parent))
    mpi = shutil.which(args.mpi) or args.mpi
    command = launcher_command(mpi, world_size, host_cores()) + [
        sys.executable, "-m", "ortflow.train.loop",
        "--config-json", json.dumps(config),
        "--data", str(args.data), "--artifacts", str(args.artifacts), "--out", str(args.out),
    ]
    print(f"ortflow train: {' '.join(command[:command.index(sys.executable)])} ...", file=sys.stderr, flush=True)
    code = subprocess.call(command, env=launcher_env(os.environ))
    if code != 0:
        print(f"ortflow train: error: the ranks exited with code {code}; the failing rank's error is above",
              file=sys.stderr)
        return code
    if args.metrics and not args.metrics.exists():
        print(f"ortflow train: error: the ranks finished but wrote no {args.metrics}", file=sys.stderr)
        return 1
    return 0
