"""`ortflow train`: check the setup, then start `train.world_size` ranks of the
training loop with the MPI launcher (mpirun locally, srun inside a Slurm job),
and watch over them:

1. Cheap checks first (training/preflight.py, and the artifacts' pipeline stages
   against the config: graphs/pipeline.py), so that a missing launcher or GPU is
   reported with its fix in a second, rather than as a hang or a traceback from
   inside a rank.
2. One attempt at a time (training/attempt.py): a lock on the run's train/ folder
   refuses a second one, and a rerun after a run that finished trains anew (the
   finished run's checkpoints and TensorBoard events move to train/previous/).
3. The ranks start and are watched over (training/supervisor.py): SIGTERM, SIGINT
   or SIGUSR1 reach them as SIGUSR1 (see stop.py), and so does the end of Snakemake
   or of this launcher, even by SIGKILL; ranks that have not stopped GRACE_S later
   are killed. A stop that comes before the ranks start ends the attempt there; one
   that comes after the ranks agreed on their last step leaves a finished run.
4. The attempt's end, said in one line and in the exit code (training/attempt.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from .. import config as config_mod
from ..artifacts import Artifacts
from ..graphs import pipeline
from ..graphs.description import read_description
from ..launcher import launcher_env
from ..training.attempt import append_to_log, end_attempt, lock_attempt, start_attempt
from ..training.preflight import preflight, raise_if_problems
from ..training.run_folder import TrainFolder
from ..training.supervisor import Ranks, note_stop_signals, rank_command, supervise

# The config keys this stage reads, which its rule passes (stages/__init__.py): the training identity,
# and export.checkpoint (training keeps the best checkpoint when the export will want it). The merge
# that picks the run's newest checkpoint by that identity is passed the same.
KEYS = ("run", "data", "model", "train", "export.checkpoint")
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
    folder = args.out
    model = Artifacts(args.artifacts)
    pipeline.check_stages(model, config.train.pipeline_stages)
    # Without model.json the ranks stop at once, naming the missing artifacts.
    description = read_description(model.model_json) if model.model_json.is_file() else None
    # The warnings go into metrics.json too: the lines printed when `snakemake` ends repeat them.
    warnings = raise_if_problems(preflight(config, args.mpi, folder.folder.parent, description,
                                           pipeline.held_by_stages(model)))
    append_to_log()
    lock = lock_attempt(folder)
    if lock is None:
        return 1
    start_attempt(folder, config.train.resume_from)
    if received:
        print(f"ortflow train: stopped by {received[0].name} before the ranks started; rerun to train",
              file=sys.stderr)
        return 128 + received[0]
    command = rank_command(args.mpi, world_size, {
        "config": config_mod.as_dict(config), "train": str(args.train), "eval": str(args.eval),
        "artifacts": str(args.artifacts), "out": str(folder), "warnings": warnings})
    print(f"ortflow train: {' '.join(command[:command.index(sys.executable)])} ...", file=sys.stderr, flush=True)
    code = supervise(command, launcher_env(os.environ), lock, received, Ranks(folder.ready, world_size))
    return end_attempt(folder, code, received, Path(args.mpi).name, config.train.steps)
