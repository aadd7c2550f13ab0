"""The training loop that every rank runs, started by `ortflow train` under mpirun or srun.

One optimizer step, on each rank:
  1. the learning rate of the schedule for this step;
  2. forward and backward over `grad_accum_steps` micro-batches of this rank's
     part of the global batch (ORT sums the gradients across the calls; each
     forward updates BatchNorm's running statistics, running_stats.py, and
     draws Dropout's masks from a generator seeded by its position);
  3. sum the gradients across ranks in place, scale the sum to the mean over
     every micro-batch of every rank, and clip it to the global norm; the
     running statistics become their mean over the ranks;
  4. the optimizer step: the weight decay of the decayed parameters, then the
     optimizer's update (weight_decay.py).
Every rank then holds the same parameters, so evaluation is split across ranks
and checkpoints can be written by all of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from .. import atomic, config as config_mod, cuda_libraries, storage
from ..artifacts import Artifacts
from ..checkpoints import resume as resume_mod, store
from ..data.shards import ShardReader
from ..errors import OrtflowError, TrainingError
from ..evaluation import evaluate, feeds, outputs_of
from ..sessions import quiet_logging, session_options
from . import comm as comm_mod
from . import stop as stop_mod
from . import weight_decay
from .gradients import average_and_clip, gradients, parameters_on_host
from .metrics import Metrics, mean_baseline_mse, peak_rss_mb, strict, unigram_perplexity
from .running_stats import RunningStats
from .schedule import learning_rate
from .stop import StopRequest, Stopped

log = logging.getLogger("ortflow.train")


def threads_per_rank(local_size: int, affinity: int, environ: dict) -> int:
    """Each rank gets its share of the node's cores. Where Slurm already pinned
    each task to its own CPUs (--cpus-per-task), the affinity is that share."""
    cpus_per_task = environ.get("SLURM_CPUS_PER_TASK")
    if cpus_per_task and affinity <= int(cpus_per_task):
        return affinity
    return max(1, affinity // local_size)


def open_sessions(artifacts: Path, state, device: str, threads: int, profile_prefix: Path | None = None):
    """The Module and the Optimizer over `state`. They can be reopened at any step:
    parameters, gradients and optimizer moments live in `state`, so training goes
    on bit for bit. With `profile_prefix`, ONNX Runtime's profiler traces both
    sessions until they are dropped, into `<prefix>-train_<time>.json` and
    `<prefix>-optimizer_<time>.json`. A traced Module has no eval graph: its
    session would take the same prefix and second as the training graph's, and
    the two traces would write over each other."""
    from onnxruntime.training.api import Module, Optimizer

    options = session_options(threads)
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = f"{profile_prefix}-train"
    files = Artifacts(artifacts)
    eval_model = None if profile_prefix else str(files.eval_model)
    module = Module(str(files.training_model), state, eval_model, device=device, session_options=options)
    if profile_prefix:  # sessions copy their options when created
        options.profile_file_prefix = f"{profile_prefix}-optimizer"
    return module, Optimizer(str(files.optimizer_model), module)


def inject_fault(fault: dict | None, step: int, rank: int, batches: list[dict], stop: StopRequest) -> None:
    """`train.fail_at_step` lets tests break one rank on purpose."""
    if not fault or fault["step"] != step or fault["rank"] != rank:
        return
    if fault["mode"] == "raise":
        raise TrainingError(f"injected failure on rank {rank} at step {step} (train.fail_at_step)")
    if fault["mode"] == "stall":  # for an hour, or until asked to stop
        log.warning("rank %d stalls at step %d (train.fail_at_step)", rank, step)
        until = time.monotonic() + 3600
        while stop.reason is None and time.monotonic() < until:
            time.sleep(0.1)
    if fault["mode"] == "nan":
        for batch in batches:
            for value in batch.values():
                if value.dtype.kind == "f":
                    value[...] = np.nan


def is_time(done: int, period: int, steps: int) -> bool:
    """Is it time for something done every `period` steps and after the last step?"""
    return done % period == 0 or done == steps


class Checkpointer:
    """Decides when the ranks write a checkpoint together, and writes it: every
    `train.checkpoint_every` steps, after the last step, and when the run stops."""

    def __init__(self, root: Path, comm, identity: dict, train_cfg: dict, global_batch: int):
        self.root, self.comm, self.identity = root, comm, identity
        self.identity_digest = config_mod.digest(identity)
        self.every, self.steps, self.keep = train_cfg["checkpoint_every"], train_cfg["steps"], \
            train_cfg["keep_checkpoints"]
        self.global_batch = global_batch
        self.last: tuple[int, Path] | None = None  # (step, folder) of the newest one written

    def due(self, done: int) -> bool:
        return is_time(done, self.every, self.steps)

    def find_resume(self, resume_from: str | None, artifacts: Path):
        """The checkpoint to go on from (see resume_mod.find_resume), or None to start at step 0."""
        return resume_mod.find_resume(self.root, self.identity, self.identity_digest, resume_from, self.steps,
                                      artifacts)

    def save(self, done: int, state, lr: float, history: dict) -> Path:
        if self.last and self.last[0] == done:
            return self.last[1]
        self.comm.watchdog.beat(done - 1, "checkpoint")
        properties = {"step": done, "lr": lr, "samples_seen": done * self.global_batch}
        folder = store.save(self.root, done, state, self.comm, self.identity, self.identity_digest,
                                 properties, self.keep, strict(history))
        self.last = (done, folder)
        return folder


def seed_random_operators(seed: int, step: int, rank: int, micro_batch: int) -> None:
    """ONNX Runtime's random operators (Dropout) draw from one generator per
    process. Seeded before every forward from (run.seed, step, rank, micro-batch),
    their masks depend only on where training is: a run repeats exactly, a resumed
    run is bit-identical to one that never stopped, and the ranks drop differently."""
    from onnxruntime.capi._pybind_state import set_seed

    set_seed(int(np.random.SeedSequence([seed, step, rank, micro_batch]).generate_state(1)[0]))


def train_step(step: int, comm, sessions: Sessions, state, batches: list[dict], feed, train_cfg: dict,
               stop: StopRequest, seed: int, decay: weight_decay.WeightDecay, lr: float) -> tuple:
    """One optimizer step (see the top of this file) with the sessions' Module and
    Optimizer, at learning rate `lr`. Returns the mean loss, the gradient norm before clipping, and every
    rank's stop votes summed."""
    module, optimizer, running_stats = sessions.module, sessions.optimizer, sessions.running_stats
    scale_to_mean = 1.0 / (train_cfg["grad_accum_steps"] * comm.world_size)
    loss_sum = 0.0
    for micro_batch, batch in enumerate(batches):
        seed_random_operators(seed, step, comm.rank, micro_batch)
        outputs = module(*feed(batch))
        running_stats.keep(outputs)
        loss, _ = outputs_of(outputs)
        loss_sum += loss
    comm.watchdog.beat(step, "allreduce")
    norm = average_and_clip(comm, gradients(state, trainable(state), comm.xp), scale_to_mean,
                            train_cfg["clip_grad_norm"])
    # The stop votes and BatchNorm's running statistics ride along with the loss:
    # neither costs a collective of its own.
    votes = stop.votes()
    summed = comm.allreduce_sum(np.concatenate([[loss_sum], votes, running_stats.local()]))
    loss_sum, votes = float(summed[0]), list(summed[1:1 + len(votes)])
    running_stats.set_mean(summed[1 + len(votes):])
    loss = loss_sum * scale_to_mean
    if math.isfinite(loss) and math.isfinite(norm):
        optimizer.set_learning_rate(lr)
        decay.apply(lr)  # torch's order: the decay, then the optimizer's update
        optimizer.step()
    module.lazy_reset_grad()
    return loss, norm, votes


def train(config: dict, train_dir: Path, eval_dir: Path, artifacts: Path, out_dir: Path, checkpoints: Path,
          profile: Path, stop: StopRequest) -> dict:
    train_cfg, steps = config["train"], config["train"]["steps"]
    out_dir.mkdir(parents=True, exist_ok=True)
    comm = comm_mod.create(train_cfg, out_dir / "heartbeat")
    rank, world_size = comm.rank, comm.world_size
    if world_size != train_cfg["world_size"]:
        raise TrainingError(f"started with {world_size} ranks but train.world_size is {train_cfg['world_size']}")
    global_batch = config_mod.global_batch_size(config)
    # Checked before the first step: checksums, batch size against the data.
    train_reader, eval_reader = ShardReader(train_dir), ShardReader(eval_dir)
    train_reader.check_batch(global_batch)
    info = Artifacts(artifacts).description()
    checkpointer = Checkpointer(checkpoints, comm, config_mod.training_identity(config), train_cfg, global_batch)
    resume = checkpointer.find_resume(train_cfg["resume_from"], artifacts)
    start_step = resume.step if resume else 0
    state = resume_mod.load_state(resume, artifacts) if resume else initial_state(artifacts)
    sessions = Sessions(artifacts, state, comm, train_cfg, profile,
                        info.get("running_stats", {}))  # absent from artifacts built before BatchNorm support
    feed = feeder(sessions.module.input_names(), info["label"]["name"], train_reader.label_name)
    decay = weight_decay.for_run(state, trainable(state), info, train_cfg["optimizer"], comm.xp)
    placement = comm.placement()  # a collective: every rank takes part
    if rank == 0:
        log.info("%d ranks, global batch %d (%d x %d accumulated x %d ranks), %s, %d threads per rank", world_size,
                 global_batch, train_cfg["micro_batch_size"], train_cfg["grad_accum_steps"], world_size,
                 f"resuming at step {start_step} from {resume.path}" if resume else "starting at step 0",
                 sessions.threads)
        log.info("ranks per node: %s", placement)
    metrics = Metrics(out_dir, rank == 0, start_step, steps, resume_mod.read_history(resume) if resume else None)
    last_eval: dict = {}
    for step in range(start_step, steps):
        sessions.at_step(step)
        started = time.perf_counter()
        comm.watchdog.beat(step, "forward")
        lr = learning_rate(step, steps, train_cfg["optimizer"]["lr"], train_cfg["lr_schedule"])
        batches = train_reader.micro_batches(step, config["run"]["seed"], rank, world_size, train_cfg["micro_batch_size"],
                                             train_cfg["grad_accum_steps"])
        inject_fault(train_cfg["fail_at_step"], step, rank, batches, stop)
        loss, norm, votes = train_step(step, comm, sessions, state, batches, feed, train_cfg, stop, config["run"]["seed"],
                                       decay, lr)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            kept = checkpointer.last[1] if checkpointer.last else (resume.path if resume else None)
            raise TrainingError(f"non-finite loss {loss} (gradient norm {norm}) at step {step + 1}; " + (
                f"the last good checkpoint, {kept}, is kept" if kept else "no checkpoint was written before it"))
        metrics.step_time(time.perf_counter() - started)
        done = step + 1
        log_step(metrics, train_cfg, done, lambda: parameters_on_host(state, trainable(state), comm.xp), loss, lr,
                 norm, global_batch / metrics.step_times[-1])
        if is_time(done, train_cfg["eval_every"], steps):
            comm.watchdog.beat(step, "eval")
            last_eval = evaluate(sessions.for_eval(), eval_reader, comm, info, train_cfg["eval_batch_size"],
                                 train_reader.label_name)
            metrics.eval(done, last_eval)
        reason = stop_mod.agreed(votes)
        if checkpointer.due(done) or reason:
            checkpointer.save(done, state, lr, metrics.history)
        if reason:  # every rank knows it from the same all-reduce
            stop_now(reason, votes, done, checkpointer, metrics, out_dir / stop_mod.STOPPED)

    return finish(config, sessions.for_eval(), comm, train_reader, eval_reader, info, metrics, last_eval, out_dir)


class Sessions:
    """The Module and Optimizer of this rank, reopened with ONNX Runtime's
    profiler on for the steps of `train.profile_steps` (traces of this run only),
    and the running statistics among the Module's outputs (`model.json` `running_stats`)."""

    def __init__(self, artifacts: Path, state, comm, train_cfg: dict, profile_dir: Path, running_stats: dict):
        self.artifacts, self.state, self.rank = artifacts, state, comm.rank
        self.device = f"cuda:{comm_mod.gpu_for(comm.local_rank, os.environ)}" if train_cfg["device"] == "cuda" \
            else "cpu"
        self.threads = threads_per_rank(comm.local_size, len(os.sched_getaffinity(0)), os.environ)
        self.profile_steps, self.profile_dir, self.profiling = train_cfg["profile_steps"], profile_dir, False
        for old in profile_dir.glob(f"rank{self.rank}-*"):
            old.unlink()
        self.module, self.optimizer = open_sessions(artifacts, state, self.device, self.threads)
        self.running_stats = RunningStats(state, self.module.output_names(), running_stats, comm)

    def at_step(self, step: int) -> tuple:
        """(module, optimizer) for training step `step`."""
        traced = bool(self.profile_steps) and self.profile_steps[0] <= step <= self.profile_steps[1]
        if traced != self.profiling:
            self.profile_dir.mkdir(exist_ok=True)
            prefix = self.profile_dir / f"rank{self.rank}-step{step}" if traced else None
            self.module, self.optimizer = open_sessions(self.artifacts, self.state, self.device, self.threads, prefix)
            self.profiling = traced
        return self.module, self.optimizer

    def for_eval(self):
        """The module, with its eval graph: a traced Module has none, so tracing pauses (until the next step)."""
        if self.profiling:
            self.module, self.optimizer = open_sessions(self.artifacts, self.state, self.device, self.threads)
            self.profiling = False
        return self.module


def feeder(input_names: list[str], label_input: str, data_label: str):
    """batch -> the Module's inputs in order."""
    return lambda batch: feeds(batch, input_names, label_input, data_label)


def trainable(state) -> list[str]:
    return [name for name, p in state.parameters if p.requires_grad]


def log_step(metrics: Metrics, train_cfg: dict, done: int, parameters, loss: float, lr: float, norm: float,
             samples_per_s: float) -> None:
    """The log line (every train.log_every steps) and the histograms of `parameters()` (every train.histogram_every)."""
    if is_time(done, train_cfg["log_every"], train_cfg["steps"]):
        metrics.train(done, loss, lr, norm, samples_per_s)
    if done % train_cfg["histogram_every"] == 0 and metrics.enabled:
        metrics.histograms(done, parameters())


def initial_state(artifacts: Path):
    from onnxruntime.training.api import CheckpointState

    return CheckpointState.load_checkpoint(str(Artifacts(artifacts).checkpoint))


def stop_now(reason, votes, done: int, checkpointer: Checkpointer, metrics: Metrics, stopped: Path) -> None:
    """Every rank agreed to stop (`votes`) and the checkpoint of step `done` is written: say so (in
    the log, and in the file `stopped`) and end."""
    where = checkpointer.last[1]
    if checkpointer.comm.rank == 0:
        log.warning("stopping after step %d of %d: %s; checkpoint %s written; rerun to resume from it",
                    done, checkpointer.steps, stop_mod.describe(votes), where)
        # For `ortflow train`, which exits with 128 + the signal (the ranks exit 0:
        # mpirun would call a non-zero exit a failure).
        atomic.write_text(stopped, json.dumps({"signal": reason.name, "step": done}))
    metrics.close()
    raise Stopped(reason, done, where)


def finish(config: dict, module, comm, train_reader: ShardReader, eval_reader: ShardReader, info: dict,
           metrics: Metrics, last_eval: dict, out_dir: Path) -> dict:
    """The final evaluation (unless the last step just did it) and metrics.json."""
    train_cfg = config["train"]
    data_label = train_reader.label_name
    if not last_eval:  # resumed at the end: nothing trained, still report the model's quality
        last_eval = evaluate(module, eval_reader, comm, info, train_cfg["eval_batch_size"], data_label)
        metrics.eval(train_cfg["steps"], last_eval)
    if comm.rank == 0:  # only rank 0 writes metrics.json
        last_eval.update(baselines(info, train_reader, eval_reader))
    flops_per_sample = sum(info["flops_per_sample"].values())
    summary = metrics.summary(train_cfg["steps"], config_mod.global_batch_size(config), flops_per_sample, last_eval,
                              comm.allgather(peak_rss_mb()))
    metrics.write(out_dir / "metrics.json", summary)
    metrics.close()
    return summary


def baselines(info: dict, train_reader: ShardReader, eval_reader: ShardReader) -> dict:
    """What a model must beat on the eval split, from the labels alone: a language
    model the unigram perplexity, a model trained with the mse loss the MSE of
    predicting the train split's label mean."""
    if info["task"] != "language_model" and info["loss"] != "mse":
        return {}
    label = train_reader.label_name
    train_labels = train_reader.gather(np.arange(len(train_reader)))[label]
    eval_labels = eval_reader.gather(np.arange(len(eval_reader)))[label]
    if info["task"] == "language_model":
        return {"unigram_perplexity": unigram_perplexity(train_labels, eval_labels, info["num_classes"])}
    return {"mean_baseline_mse": mean_baseline_mse(train_labels, eval_labels)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of `ortflow train` (start it with mpirun or srun)")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--train", required=True, type=Path, help="folder of the train split's shards")
    parser.add_argument("--eval", required=True, type=Path, help="folder of the eval split's shards")
    parser.add_argument("--artifacts", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="the run's train/ folder")
    parser.add_argument("--checkpoints", required=True, type=Path, help="the checkpoints folder")
    parser.add_argument("--profile", required=True, type=Path, help="the folder of ONNX Runtime's profiler traces")
    args = parser.parse_args(argv)
    stop = StopRequest().install(args.out / stop_mod.READY)  # first: a stop during the imports is kept too

    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    quiet_logging()
    try:
        config = config_mod.validate(json.loads(args.config_json))
        if config["train"]["device"] == "cuda":  # before ONNX Runtime loads its CUDA provider
            cuda_libraries.preload()
        train(config, args.train, args.eval, args.artifacts, args.out, args.checkpoints, args.profile, stop)
    except Stopped:
        # Every rank stops here together, without MPI_Abort.
        logging.shutdown()
        sys.stderr.flush()
        if stop.orphaned:  # MPI_Finalize would wait for the mpirun that is gone
            os._exit(0)
    except BaseException as error:  # noqa: BLE001 - any failure on one rank must end all ranks
        # A full disk or a read-only folder: one line with the path and what to do.
        problem = storage.explain(error) if isinstance(error, OSError) else None
        known = problem or isinstance(error, OrtflowError)  # anything else is a bug: keep its traceback
        log.error("rank %d failed: %s", rank, problem or error, exc_info=not known)
        logging.shutdown()
        sys.stderr.flush()
        # Without Abort, the other ranks would wait forever in their next collective.
        MPI.COMM_WORLD.Abort(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
