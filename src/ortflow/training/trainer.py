"""The training loop that every rank runs, started by `ortflow train` under mpirun or srun.

One optimizer step, on each rank (Trainer.train_step):
  1. forward and backward over `grad_accum_steps` micro-batches of this rank's
     part of the global batch (ORT sums the gradients across the calls; each
     forward updates BatchNorm's running statistics, running_stats.py, and
     draws Dropout's masks from a generator seeded by its position);
  2. sum the gradients across ranks in place (all of them, or under train.zero 1
     each rank the part it owns: sharding.py), scale the sum to the mean over
     every micro-batch of every rank, and clip it to the global norm; the
     running statistics become their mean over the ranks;
  3. the optimizer step at the schedule's learning rate over what the rank
     owns (optimizer.py): the weight decay of the decayed parameters
     (weight_decay.py), then the optimizer's update; under train.zero 1 the
     updated parts are then gathered on every rank.
Every rank then holds the same parameters, so evaluation is split across ranks
and checkpoints can be written by all of them. Around the step (Trainer.step):
the log (metrics.py decides when), evaluation, the checkpoint (checkpointer.py
decides when), and a stop that a signal asked for (stop.py).

With train.pipeline_stages P > 1, each rank holds one stage of the model instead
(`PipelinedTrainer`, the 1F1B step of pipeline_schedule.py) in the same loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from .. import config as config_mod, cuda_libraries, ort_private, storage
from ..artifacts import Artifacts
from ..checkpoints import resume as resume_mod
from ..data import baseline as baseline_mod
from ..data.shards import ShardReader
from ..errors import OrtflowError, TrainingError
from ..evaluation import evaluate, feeds, outputs_of
from ..graphs import pipeline
from ..graphs.description import read_description
from ..sessions import quiet_logging
from ..wording import plural
from ..checkpoints.checks import MOMENTS
from . import comm as comm_mod
from . import sharding
from . import stop as stop_mod
from . import weight_decay
from .best import Best
from .checkpointer import Checkpointer, live_part
from .engine import (
    Sessions, initial_state, load_parameters, seed_random_operators, threads_per_rank, trainable, with_parameters,
)
from .faults import Fault
from .gradients import parameters, parameters_on_host
from .optimizer import Optimizer
from .pipeline_schedule import Grid, StageRunner, place
from .metrics import Metrics, peak_rss_mb
from .run_summary import BestEval, RunSummary
from .run_folder import AttemptStopped, TrainFolder, write_stopped
from .schedule import is_time, learning_rate
from .stop import StopRequest, Stopped

log = logging.getLogger("ortflow.train")


class Trainer:
    """One rank's training run, built once from the config, the data's split
    folders, the artifacts and the training folder. It holds its components:
    the communicator, ONNX Runtime's sessions over the live state, the
    checkpointer, the metrics, the weight decay and the stop request."""

    def __init__(self, config: config_mod.Config, train_data: Path, eval_data: Path, artifacts: Artifacts,
                 folder: TrainFolder, stop: StopRequest, *, warnings: tuple[str, ...] = ()):
        """`warnings`: the train preflight's (`ortflow train` ran it), kept in metrics.json."""
        self.train_cfg, self.folder, self.stop_request, self.warnings = config.train, folder, stop, warnings
        self.steps, self.seed = self.train_cfg.steps, config.run.seed
        folder.folder.mkdir(parents=True, exist_ok=True)
        self.comm = comm_mod.create(self.train_cfg, folder.heartbeat)
        if self.comm.world_size != self.train_cfg.world_size:
            raise TrainingError(f"started with {plural(self.comm.world_size, 'rank')} but train.world_size is "
                                f"{self.train_cfg.world_size}")
        # Checked before the first step: checksums, batch size against the data.
        self.train_data, self.eval_data = ShardReader(train_data), ShardReader(eval_data)
        self.artifacts, self.info = artifacts, read_description(artifacts.model_json)
        # What the model must beat on the eval split, as prepare_data scored it.
        self.baseline = baseline_mod.for_training(eval_data, self.info.loss)
        self.global_batch = config_mod.global_batch_size(config)
        self.train_data.check_batch(self.global_batch)
        # The data-parallel copy of the model this rank is, of how many: with P = 1, its rank of all.
        _, self.copy = place(self.comm.rank, self.comm.world_size, self.train_cfg.pipeline_stages)
        self.copies = config_mod.data_parallel_size(self.train_cfg)
        self.checkpointer = Checkpointer(folder.checkpoints, self.comm, config)
        resume = self.checkpointer.find_resume(self.train_cfg.resume_from, artifacts.folder)
        self.start_step, self.resumed_from = (resume.step, resume.path) if resume else (0, None)
        # The whole model's state (any world size and P), checked against the whole model's parameters.
        self.open_engine(resume_mod.load_state(resume, artifacts.folder) if resume else None)
        self.metrics = Metrics(folder.tensorboard, self.comm.rank == 0, self.start_step, self.train_cfg,
                               self.global_batch,
                               resume_mod.read_history(resume) if resume else None)
        self.best = Best(self.train_cfg.early_stopping, self.info.task, self.metrics.history["eval"])
        self.keep_best = config_mod.export_checkpoint(config) == "best"  # the export will want it
        self.fault = Fault()
        self.last_eval: dict = {}
        self.whole_eval_at: int | None = None  # the step after which the whole eval split was read
        self.log_start()

    def open_engine(self, whole) -> None:
        """This rank's engine over the whole model, from the initial weights or those of `whole`
        (a checkpoint's TrainingState): the live state, ONNX Runtime's sessions, the gradient
        sums (sharding.py), the optimizer and weight decay, and what the rank writes of a checkpoint."""
        self.state = with_parameters(self.artifacts, whole, self.comm.xp) if whole else initial_state(self.artifacts)
        self.sessions = Sessions(self.artifacts, self.state, self.comm, self.train_cfg, self.folder.profile,
                                 self.info.running_stats)  # absent from artifacts built before BatchNorm
        self.threads = self.sessions.threads
        self.input_names = self.sessions.module.input_names()
        self.trainable = trainable(self.state)
        # What each rank writes of a checkpoint, which is also what it owns under train.zero 1.
        layout = sharding.layout(self.state, self.trainable, len(MOMENTS[self.train_cfg.optimizer.name]),
                                 self.comm.world_size, self.comm.xp)
        self.slices = layout[self.comm.rank]
        self.sharding = sharding.for_run(self.train_cfg, self.state, self.trainable, self.comm, layout)
        self.optimizer = Optimizer(self.state, self.sharding.pieces, self.train_cfg.optimizer, self.comm.xp)
        if whole:
            self.optimizer.load(whole.optimizer, whole.optimizer_states)
        self.decay = weight_decay.for_run(self.state, self.trainable, self.info, self.train_cfg.optimizer,
                                          self.comm.xp)

    def run(self) -> RunSummary:
        """Train from the start step (0, or the checkpoint's) to train.steps, or until
        train.early_stopping's patience runs out; then metrics.json."""
        done = self.start_step
        while done < self.steps and not self.best.exhausted:
            self.step(done)
            done += 1
        if self.best.exhausted and self.comm.rank == 0:
            log.warning("early stopping after step %d of %d: eval %s has not improved by more than %g for %d "
                        "evaluations; the best, %.6g, was after step %d", done, self.steps, self.best.metric,
                        self.best.min_delta, self.best.since, self.best.value, self.best.step)
        return self.finish(done)

    def step(self, step: int) -> None:
        """Optimizer step `step` (0-based), then what is due after it: log, evaluate, checkpoint, stop."""
        started = time.perf_counter()
        self.comm.watchdog.beat(step, "forward")
        lr = learning_rate(step, self.steps, self.train_cfg.optimizer.lr, self.train_cfg.lr_schedule)
        batches = self.train_data.micro_batches(step, self.seed, self.copy, self.copies,
                                                self.train_cfg.micro_batch_size, self.train_cfg.grad_accum_steps)
        self.fault.inject(step, self.comm.rank, batches, self.stop_request)
        loss, norm, votes = self.train_step(step, batches, lr)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            kept = self.checkpointer.last[1] if self.checkpointer.last else self.resumed_from
            raise TrainingError(f"non-finite loss {loss} (gradient norm {norm}) at step {step + 1}; " + (
                f"the last good checkpoint, {kept}, is kept" if kept else "no checkpoint was written before it"))
        self.metrics.step_time(time.perf_counter() - started)
        done = step + 1
        self.metrics.log_step(done, loss, lr, norm, lambda: parameters_on_host(self.state, self.trainable,
                                                                               self.comm.xp))
        new_best = False
        if is_time(done, self.train_cfg.eval_every, self.steps):
            self.evaluate(done, whole=done == self.steps)
            new_best = self.best.update(done, self.last_eval) and self.keep_best
        reason = stop_mod.agreed(votes)  # every rank knows it from the same all-reduce
        if self.checkpointer.should_save(done, reason, new_best, self.best.exhausted):
            self.checkpointer.save(done, self.checkpoint_part, lr, self.metrics.history)
        if new_best:
            self.checkpointer.mark_best(done, self.best.describe())
        if reason:
            self.stop(reason, votes, done)

    def train_step(self, step: int, batches: list[dict], lr: float) -> tuple[float, float, list[float]]:
        """Forward, backward, all-reduce and the optimizer step at learning rate `lr`
        (see the top of this file). Returns the mean loss, the gradient norm before
        clipping, and every rank's stop votes summed."""
        self.sessions.at_step(step)
        module, running_stats = self.sessions.module, self.sessions.running_stats
        scale_to_mean = 1.0 / (self.train_cfg.grad_accum_steps * self.comm.world_size)
        loss_sum = 0.0
        for micro_batch, batch in enumerate(batches):
            seed_random_operators(self.seed, step, self.comm.rank, micro_batch)
            outputs = module(*self.feeds(batch))
            running_stats.keep(outputs)
            loss_sum += outputs_of(outputs)[0]
        self.comm.watchdog.beat(step, "allreduce")
        norm = self.sharding.average_and_clip(scale_to_mean, self.train_cfg.clip_grad_norm)
        # The stop votes and BatchNorm's running statistics ride along with the loss:
        # neither costs a collective of its own.
        votes = self.stop_request.votes()
        summed = self.comm.allreduce_sum(np.concatenate([[loss_sum], votes, running_stats.local()]))
        loss, votes = float(summed[0]) * scale_to_mean, list(summed[1:1 + len(votes)])
        running_stats.set_mean(summed[1 + len(votes):])
        if math.isfinite(loss) and math.isfinite(norm):  # the same on every rank: both are sums over all of them
            # torch's order: the decay, then the optimizer's update
            self.optimizer.step(lr, self.sessions.optimizer_step, self.decay)
            self.sharding.gather()
        module.lazy_reset_grad()
        return loss, norm, votes

    def checkpoint_part(self):
        """This rank's shard of a checkpoint now (checkpointer.live_part)."""
        return live_part(self.state, self.slices, set(self.trainable), self.optimizer, self.comm.xp)

    def feeds(self, batch: dict) -> list[np.ndarray]:
        """`batch` as the Module's inputs, in order."""
        return feeds(batch, self.input_names, self.info.label.name, self.train_data.label_name)

    def evaluate(self, done: int, whole: bool) -> None:
        """Evaluate after step `done`: the `whole` eval split, or train.eval_batches of it."""
        self.comm.watchdog.beat(done - 1, "eval")
        bound = self.train_cfg.eval_batches
        records = bound * self.train_cfg.eval_batch_size if bound and not whole else None
        self.last_eval = self.evaluation(records)
        self.whole_eval_at = done if whole else None
        self.metrics.eval(done, self.last_eval)

    def evaluation(self, records: int | None) -> dict:
        """The loss and metrics of the eval split (or its first `records`), split across the ranks."""
        return evaluate(self.sessions.for_eval(), self.eval_data, self.comm, self.info,
                        self.train_cfg.eval_batch_size, self.train_data.label_name, records)

    def stop(self, reason, votes, done: int) -> None:
        """Every rank agreed to stop (`votes`) and the checkpoint of step `done` is written:
        say so (in the log, and in STOPPED for the launcher) and end."""
        where = self.checkpointer.last[1]
        if self.comm.rank == 0:
            log.warning("stopping after step %d of %d: %s; checkpoint %s written; rerun to resume from it",
                        done, self.steps, stop_mod.describe(votes), where)
            # For `ortflow train`, which exits with 128 + the signal (the ranks exit 0:
            # mpirun would call a non-zero exit a failure).
            write_stopped(self.folder, AttemptStopped(reason.name, done))
        self.metrics.close()
        raise Stopped(reason, done, where)

    def engine_summary(self) -> dict:
        """What the engine adds to metrics.json (PipelinedTrainer: its stages' waits)."""
        return {}

    def finish(self, done: int) -> RunSummary:
        """The evaluation of the whole eval split after step `done` (unless the last one was
        that: a run resumed at its end, or stopped early, still reports its quality) and metrics.json."""
        if self.whole_eval_at != done:
            self.evaluate(done, whole=True)
        flops_per_sample = self.info.flops_per_sample.forward + self.info.flops_per_sample.backward
        summary = RunSummary(**self.metrics.summary(done, flops_per_sample, self.last_eval,
                                                    self.comm.allgather(peak_rss_mb())),
                             best=BestEval(**self.best.describe()), stopped_early=done < self.steps,
                             baseline=self.baseline, parameters=self.info.parameters,
                             trainable_parameters=self.info.trainable_parameters, warnings=self.warnings,
                             **self.engine_summary())
        behind = baseline_mod.not_beaten(self.last_eval, self.baseline)
        if behind and self.comm.rank == 0:
            log.warning("%s", behind)
        self.fault.inject(done, self.comm.rank, [], self.stop_request)  # the moment the run ends (faults.py)
        self.metrics.write(self.folder.metrics, summary)
        self.metrics.close()
        return summary

    def log_start(self) -> None:
        placement = self.comm.placement()  # a collective: every rank takes part
        if self.comm.rank == 0:
            train = self.train_cfg
            log.info("%s, global batch %d (%d x %d accumulated x %s), %s, %d threads per rank",
                     plural(self.comm.world_size, "rank"), self.global_batch, train.micro_batch_size,
                     train.grad_accum_steps, self.batch_split(),
                     f"resuming at step {self.start_step} from {self.resumed_from}" if self.resumed_from
                     else "starting at step 0",
                     self.threads)
            log.info("ranks per node: %s", placement)
            if train.zero:
                log.info("%s", self.zero_saving())

    def batch_split(self) -> str:
        """What splits the global batch, for the log: every rank takes its part."""
        return plural(self.comm.world_size, "rank")

    def zero_saving(self) -> str:
        """What train.zero 1 saves on this rank, measured: the optimizer moments it does
        not hold, against holding every parameter's (as train.zero 0 does), of its stage's
        when pipelined (sharded over the stage's copies)."""
        held = sum(array.nbytes for moment in self.optimizer.moments.values() for array in moment.values())
        every = len(self.optimizer.moment_names) * sum(
            array.nbytes for array in parameters(self.state, self.trainable, self.comm.xp))
        return (f"train.zero 1: the optimizer's moments sharded over {plural(self.copies, 'rank')}: "
                f"rank {self.comm.rank} holds {held / 1e6:,.2f} MB of {every / 1e6:,.2f} MB, "
                f"saving {(every - held) / 1e6:,.2f} MB")


class PipelinedTrainer(Trainer):
    """train.pipeline_stages P > 1: this rank trains one stage of the model (its copy, of
    D = world_size / P: pipeline_schedule.py's grid), in the Trainer's run. What differs
    from P = 1 is the engine (pipeline_schedule.StageRunner: the stage's own state, the
    1F1B step, evaluation through the stages), what the rank writes of a checkpoint (its
    part of its stage: together the shards hold the whole model once, so merge, export,
    quantize and resume at any P read them as a P = 1 run's), and the log's first lines.
    TensorBoard's histograms are those of rank 0's stage, the first."""

    def open_engine(self, whole) -> None:
        plan = pipeline.read_plan(self.artifacts.pipeline_json)  # its stages checked by `ortflow train`
        grid = Grid(self.comm.world, self.train_cfg.pipeline_stages, plan.tied, self.comm.watchdog.collective)
        self.threads = threads_per_rank(self.comm.local_size, len(os.sched_getaffinity(0)), os.environ)
        self.runner = StageRunner(self.artifacts, plan, grid, self.train_cfg, self.seed, self.threads,
                                  self.train_data.label_name)
        self.state, self.trainable, self.optimizer = self.runner.state, self.runner.trainable, self.runner.optimizer
        if whole:  # the stage's part of the whole model's state
            load_parameters(self.state, whole, np)
            self.optimizer.load(whole.optimizer, whole.optimizer_states)
        self.slices = self.runner.checkpoint_slices()

    def train_step(self, step: int, batches: list[dict], lr: float) -> tuple[float, float, list[float]]:
        self.comm.watchdog.beat(step, "schedule")
        return self.runner.train_step(step, batches, lr, self.stop_request.votes())

    def evaluation(self, records: int | None) -> dict:
        return self.runner.evaluate(self.eval_data, self.train_cfg.eval_batch_size, records)

    def engine_summary(self) -> dict:
        """Each rank's share of its steps spent waiting on other stages, against 1F1B's bubble."""
        waited = self.comm.allgather(self.runner.waited_share())
        stages, micro_batches = self.runner.grid.stages, self.train_cfg.grad_accum_steps
        bubble = (stages - 1) / (micro_batches + stages - 1)
        if self.comm.rank == 0 and None not in waited:
            log.info("pipeline stages: ranks waited on other stages %s of their steps (1F1B's bubble at %s "
                     "and %s: %.0f%%)", ", ".join(f"{share:.0%}" for share in waited), plural(stages, "stage"),
                     plural(micro_batches, "micro-batch"), 100 * bubble)
        return {"pipeline_waited_share": tuple(waited), "pipeline_bubble": bubble}

    def batch_split(self) -> str:
        copies = self.runner.grid.copies_count
        return f"{copies} {'copy' if copies == 1 else 'copies'} of {plural(self.runner.grid.stages, 'stage')}"

    def log_start(self) -> None:
        super().log_start()
        stages = self.comm.allgather((self.runner.grid.stage, len(self.state.parameters)))
        if self.comm.rank == 0:
            log.info("pipeline stages: %s", "; ".join(
                f"rank {rank}: stage {stage} ({plural(held, 'parameter tensor')})"
                for rank, (stage, held) in enumerate(stages)))


def main(argv: list[str] | None = None) -> int:
    """One rank. Its one argument is the JSON that `ortflow train` writes (supervisor.rank_command,
    the only command line that starts it): {"config", "train", "eval", "artifacts", "out", "warnings"}."""
    ort_private.skip_ortmodule()
    job = json.loads((argv or sys.argv[1:])[0])
    folder = TrainFolder(job["out"])
    stop = StopRequest().install(folder.ready)  # first: a stop during the imports is kept too

    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    quiet_logging()
    try:
        config = config_mod.typed(job["config"])  # as `ortflow train` validated it
        if config.train.device == "cuda":  # before ONNX Runtime loads its CUDA provider
            cuda_libraries.preload()
        run = PipelinedTrainer if config.train.pipeline_stages > 1 else Trainer
        run(config, Path(job["train"]), Path(job["eval"]), Artifacts(job["artifacts"]), folder, stop,
            warnings=tuple(job["warnings"])).run()
        stop.settle()
    except Stopped:
        # Every rank stops here together, without MPI_Abort.
        stop.settle()
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
