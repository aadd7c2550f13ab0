"""This rank's ONNX Runtime training engine: the Module (training and eval
graphs) over the live CheckpointState and the optimizer's step (optimizer.py), with its threads and
device, reopened with ONNX Runtime's profiler for the steps of train.profile_steps."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..artifacts import Artifacts
from ..graphs import precision
from ..sessions import share_cpu_arena, training_options
from . import comm as comm_mod
from .gradients import parameters
from .optimizer import open_step
from .running_stats import RunningStats


def threads_per_rank(local_size: int, affinity: int, environ: dict) -> int:
    """Each rank gets its share of the node's cores. Where Slurm already pinned
    each task to its own CPUs (--cpus-per-task), the affinity is that share."""
    cpus_per_task = environ.get("SLURM_CPUS_PER_TASK")
    if cpus_per_task and affinity <= int(cpus_per_task):
        return affinity
    return max(1, affinity // local_size)


def open_sessions(artifacts: Artifacts, state, device: str, threads: int, optimizer, xp,
                  profile_prefix: Path | None = None, recompute: bool = False):
    """The Module over `state` and the step of the optimizer `optimizer`
    (train.optimizer; optimizer.py). They can be reopened at any step: parameters and gradients live
    in `state`, the moments in the Trainer's Optimizer, so training goes on bit for
    bit. With `profile_prefix`, ONNX Runtime's profiler traces both sessions until
    they are dropped, into `<prefix>-train_<time>.json` and
    `<prefix>-optimizer_<time>.json`. A traced Module has no eval graph: its
    session would take the same prefix and second as the training graph's, and
    the two traces would write over each other. `recompute`: the training graph was rewritten
    by train.recompute, whose sessions reuse memory otherwise (sessions.training_options). Artifacts
    built with train.precision: bf16 bring their operator's library (graphs/precision.py). The
    sessions share one CPU arena (sessions.share_cpu_arena)."""
    from onnxruntime.training.api import Module

    options = training_options(threads, recompute)
    share_cpu_arena(options)
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = f"{profile_prefix}-train"
    training_model, eval_model = precision.module_graphs(artifacts, options, threads)
    module = Module(training_model, state, None if profile_prefix else eval_model, device=device,
                    session_options=options)
    if profile_prefix:  # sessions copy their options when created
        options.profile_file_prefix = f"{profile_prefix}-optimizer"
    return module, open_step(optimizer, artifacts.optimizer_model, options, xp)


def with_parameters(artifacts: Artifacts, whole, xp):
    """The CheckpointState of the artifacts with the parameters of `whole` (a checkpoint's
    TrainingState, checked against the artifacts) copied into its live buffers."""
    state = initial_state(artifacts)
    load_parameters(state, whole, xp)
    return state


def load_parameters(state, whole, xp) -> None:
    """The parameters of `whole` (a checkpoint's TrainingState) copied into the live buffers of
    `state`, each of its own: a pipeline stage's state holds some of the whole model's."""
    names = [name for name, _ in state.parameters]
    for array, value in zip(parameters(state, names, xp), (whole.parameters[name] for name in names)):
        array[...] = xp.asarray(value)


def initial_state(artifacts: Artifacts):
    """The CheckpointState that build_artifacts wrote: the initial weights."""
    from onnxruntime.training.api import CheckpointState

    return CheckpointState.load_checkpoint(str(artifacts.checkpoint))


def trainable(state) -> list[str]:
    """The names of the parameters the optimizer updates."""
    return [name for name, p in state.parameters if p.requires_grad]


def seed_random_operators(seed: int, step: int, rank: int, micro_batch: int, offset: int = 0) -> None:
    """ONNX Runtime's random operators (Dropout) draw from one generator per
    process. Seeded before every forward from (run.seed, step, rank, micro-batch),
    their masks depend only on where training is: a run repeats exactly, a resumed
    run is bit-identical to one that never stopped, and the ranks drop differently.
    A pipeline stage adds the Dropouts of the stages before it (`offset`): each Dropout
    call advances the seed by one, so it draws the whole model's masks (graphs/pipeline.py)."""
    import onnxruntime

    onnxruntime.set_seed(int(np.random.SeedSequence([seed, step, rank, micro_batch]).generate_state(1)[0]) + offset)


class Sessions:
    """The Module and the optimizer's step of this rank, reopened with ONNX Runtime's
    profiler on for the steps of `train.profile_steps` (traces of this run only),
    and the running statistics among the Module's outputs (`model.json` `running_stats`)."""

    def __init__(self, artifacts: Artifacts, state, comm, train_cfg, profile_dir: Path, running_stats: dict):
        self.artifacts, self.state, self.rank = artifacts, state, comm.rank
        self.device = f"cuda:{comm_mod.gpu_for(comm.local_rank, os.environ)}" if train_cfg.device == "cuda" \
            else "cpu"
        self.threads = threads_per_rank(comm.local_size, len(os.sched_getaffinity(0)), os.environ)
        self.profile_steps, self.profile_dir, self.profiling = train_cfg.profile_steps, profile_dir, False
        self.optimizer_cfg, self.xp = train_cfg.optimizer, comm.xp
        self.recompute = train_cfg.recompute != "none"
        for old in profile_dir.glob(f"rank{self.rank}-*"):
            old.unlink()
        self.module, self.optimizer_step = self.open()
        self.running_stats = RunningStats(state, self.module.output_names(), running_stats, comm)

    def at_step(self, step: int) -> None:
        """Trace training step `step` if train.profile_steps asks for it (and stop tracing after)."""
        traced = bool(self.profile_steps) and self.profile_steps[0] <= step <= self.profile_steps[1]
        if traced != self.profiling:
            self.profile_dir.mkdir(exist_ok=True)
            prefix = self.profile_dir / f"rank{self.rank}-step{step}" if traced else None
            self.module, self.optimizer_step = self.open(prefix)
            self.profiling = traced

    def for_eval(self):
        """The module, with its eval graph: a traced Module has none, so tracing pauses (until the next step)."""
        if self.profiling:
            self.module, self.optimizer_step = self.open()
            self.profiling = False
        return self.module

    def open(self, profile_prefix: Path | None = None):
        return open_sessions(self.artifacts, self.state, self.device, self.threads, self.optimizer_cfg, self.xp,
                             profile_prefix, self.recompute)
