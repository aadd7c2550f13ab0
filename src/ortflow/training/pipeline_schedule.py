"""The 1F1B schedule of pipeline stages (issue 32; the stages' graphs: graphs/pipeline.py).

The ranks form a grid of P = train.pipeline_stages stages x D = world_size / P copies:
rank r holds stage r // D as copy r % D. The copies of a stage are neighbouring
ranks because their all-reduce carries the whole stage's gradients every step,
the largest traffic, while only one activation per micro-batch crosses between
stages; with ranks placed in blocks over nodes (mpirun's and Slurm's default), a
stage's copies share a node and the stages split across nodes (DeepSpeed's pipeline
topology orders its axes so too). Communicators (`Grid`):
  - `copies`: the D ranks of this stage, which all-reduce its gradients;
  - `column`: the P stages of this copy, in stage order: activations go to the next
    stage and their gradients back to the previous one, point to point;
  - `tied`: for each set of stages holding the same weights (Plan.tied, GPT-2's
    token embedding and its head), those stages of this copy, which sum their parts
    of those weights' gradients.

One optimizer step on a rank (`StageRunner.train_step`), over m = grad_accum_steps
micro-batches of the copy's part of the global batch (as a rank of a P = 1 run
with D ranks reads them):
  1. warm-up: P - 1 - s forwards (stage s); then one forward, one backward until
     every micro-batch has gone forward; then the backwards left (cool-down). A
     stage's forward is its eval graph with Dropout on and a zero upstream gradient
     (`Module` runs forward and backward in one call, so the output to send comes
     from a forward of its own), its backward its training step on the gradient
     received, the forward again; the last stage's forward and backward are its
     training step. Each forward of a micro-batch is seeded as a P = 1 run seeds
     it, plus the Dropouts before the stage, so that it draws the whole model's masks.
     Sends are non-blocking and waited for at the end of the step: a blocking send
     of an activation while the next stage sends a gradient back could wait forever
     once messages are too large to be buffered.
  2. tied weights' gradients summed over their stages, micro-batch by micro-batch: a
     P = 1 run adds each micro-batch's uses of the weight, then accumulates those sums,
     and the same additions in the same order give the same bits (each stage sets its
     parts aside after every backward, leaving zeros to accumulate on). Summed per stage
     first, the last bits differed, and AdamW turned that into differences of 2.6e-6 in 20
     steps on the attention's key bias, whose gradient is only rounding. Then the stage's
     gradients summed over its copies by sharding.py, as a P = 1 run sums them over its
     ranks: all-reduced, or under train.zero 1 reduce-scattered, each copy holding the sum
     of its run of the stage's parameters (the stage's layout, cut as a P = 1 run's);
  3. the global norm from every stage's sum of squares (a tied weight counted
     once, in its first stage), and the loss from the last stage: one all-reduce
     over all ranks; then the gradients scaled to the mean and clipped as with P = 1;
  4. the stage's optimizer step (its own moments; every holder of a tied weight
     applies the same update to the same weight), over what the copy owns; under
     train.zero 1 the updated runs are then gathered on every copy of the stage.

An evaluation (`StageRunner.evaluate`) sends each eval batch forward through the stages
with Dropout off; the last stage adds up the loss and metrics as a P = 1 rank does.

The train stage runs these steps in training/trainer.py's PipelinedTrainer, inside the
Trainer's log, metrics, evaluation periods, early stopping, stop requests and checkpoints
(each rank writes its part of its stage: `checkpoint_slices`). Every wait on another
rank (a receive, the sends' end, a sum) runs under the watchdog (`watch`), which ends
the run when it lasts longer than train.collective_timeout_s.
Not here yet: BatchNorm (refused by the cut), CUDA.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque

import numpy as np

from ..artifacts import Artifacts
from ..checkpoints.checks import MOMENTS
from ..data.shards import ShardReader
from ..evaluation import Tally, feeds as feeds_in_order
from ..graphs import pipeline
from ..graphs.description import read_description
from . import sharding, weight_decay
from .engine import initial_state, open_sessions, seed_random_operators, trainable
from .gradients import allreduce_in_buckets, gradients, scale_and_clip
from .optimizer import Optimizer


def place(rank: int, world_size: int, stages: int) -> tuple[int, int]:
    """(stage, copy) of `rank`: the copies of a stage are neighbouring ranks (see the top)."""
    return divmod(rank, world_size // stages)


def warm_up(stage: int, stages: int, micro_batches: int) -> int:
    """The forwards stage `stage` runs before its first backward: as many as the stages
    after it, whose backwards it waits for (the last stage none)."""
    return min(stages - 1 - stage, micro_batches)


class Sums:
    """Sums over one communicator, the interface gradients.py and sharding.py take from a rank's comm
    (comm.MPIComm); `group` names its ranks to the watchdog (`watch`)."""

    xp = np

    def __init__(self, comm, watch, group: str):
        from mpi4py import MPI

        self.comm, self.MPI, self.watch, self.group = comm, MPI, watch, group
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self._buckets: dict = {}

    def allreduce_gradients(self, grads: list) -> None:
        if self.world_size > 1:
            allreduce_in_buckets(grads, np, self.reduce_flat, self._buckets)

    def reduce_flat(self, flat) -> None:
        with self.watch(f"allreduce(gradients of {self.group})"):
            self.comm.Allreduce(self.MPI.IN_PLACE, flat)

    def reduce_scatter_flat(self, flat, mine, counts: list[int]) -> None:
        """train.zero 1: this rank's run (`counts` elements each, in rank order) of the sum of `flat`, into `mine`."""
        with self.watch(f"reduce_scatter(gradients of {self.group})"):
            self.comm.Reduce_scatter(flat, mine, counts, op=self.MPI.SUM)

    def allgather_flat(self, mine, flat, counts: list[int]) -> None:
        """train.zero 1: every rank's run (this rank's is `mine`) of `counts` elements into `flat`, in rank order."""
        with self.watch(f"allgather(parameters of {self.group})"):
            self.comm.Allgatherv(mine, [flat, counts])


class Grid:
    """This rank's stage and copy in the grid of P stages x D copies, and its communicators (see
    the top). `watch(what)` is the watchdog's scope of a wait on other ranks (comm.Watchdog.collective)."""

    def __init__(self, world, stages: int, tied: dict[str, list[int]], watch):
        from mpi4py import MPI

        self.MPI, self.world, self.stages, self.watch = MPI, world, stages, watch
        self.copies_count = world.Get_size() // stages
        self.stage, self.copy = place(world.Get_rank(), world.Get_size(), stages)
        self.copies = Sums(world.Split(color=self.stage, key=self.copy), watch, f"stage {self.stage}")
        self.column = world.Split(color=self.copy, key=self.stage)  # rank in it = stage
        # Every rank takes part in each Split, in the same order; the stages outside a group get no communicator.
        self.tied: dict[tuple[int, ...], Sums] = {}
        for holders in sorted({tuple(held) for held in tied.values()}):
            member = self.stage in holders
            comm = world.Split(color=self.copy if member else MPI.UNDEFINED, key=self.stage)
            if member:
                self.tied[holders] = Sums(comm, watch, f"the tied weights of stages {list(holders)}")


class StageRunner:
    """This rank's stage: its Module over its own CheckpointState, its optimizer and weight
    decay, and the 1F1B step over micro-batches (see the top)."""

    def __init__(self, artifacts: Artifacts, plan: pipeline.Plan, grid: Grid, train_cfg, seed: int, threads: int,
                 data_label: str):
        self.plan, self.grid, self.train_cfg, self.seed = plan, grid, train_cfg, seed
        self.data_label = data_label  # the train split's name of the label
        self.stage = plan.stages[grid.stage]
        self.last = grid.stage == grid.stages - 1
        self.info = read_description(artifacts.model_json)  # the whole model's: its label, loss and embeddings
        own = artifacts.stage(grid.stage)
        self.state = initial_state(own)
        self.module, self.optimizer_step = open_sessions(own, self.state, "cpu", threads, train_cfg.optimizer, np)
        self.trainable = trainable(self.state)
        # The stage's parameters cut over its copies as a P = 1 run's are over its ranks: what each
        # copy steps under train.zero 1 (sharding.py) and, but for the tied weights an earlier stage
        # writes, what it writes of a checkpoint.
        self.layout = sharding.layout(self.state, self.trainable, len(MOMENTS[train_cfg.optimizer.name]),
                                      grid.copies_count, np)
        self.sharding = sharding.for_run(train_cfg, self.state, self.trainable, grid.copies, self.layout)
        self.optimizer = Optimizer(self.state, self.sharding.pieces, train_cfg.optimizer, np)
        self.decay = weight_decay.for_run(self.state, self.trainable, self.info, train_cfg.optimizer, np)
        # A tied weight's gradient is summed over its stages; its norm counted in the first of them.
        self.tied_groups = {holders: [n for n in self.trainable if tuple(plan.tied.get(n, ())) == holders]
                            for holders in grid.tied}
        self.counted = [n for n in self.trainable if plan.tied.get(n, [grid.stage])[0] == grid.stage]
        self.tied_names = [name for names in self.tied_groups.values() for name in names]
        # Per step: (seconds waited on other stages, seconds of the step). See waited_share.
        self.waits: list[tuple[float, float]] = []
        self.waited = 0.0

    def train_step(self, step: int, batches: list[dict], lr: float, votes: list[float]) -> tuple[float, float, list]:
        """Optimizer step `step` over this copy's micro-batches `batches` at learning rate `lr`.
        Returns the mean loss, the gradient norm before clipping and every rank's stop `votes`
        (stop.py) summed, the same on every rank."""
        m, cfg = len(batches), self.train_cfg
        started, self.waited = time.perf_counter(), 0.0
        sends: list = []
        forwarded: deque = deque()  # (micro-batch, its feeds) gone forward, whose backward is due
        loss_sum = 0.0
        parts: dict[str, list] = {name: [] for name in self.tied_names}  # each micro-batch's tied gradients
        for micro_batch in range(m + warm_up(self.grid.stage, self.grid.stages, m)):
            if micro_batch < m:
                forwarded.append((micro_batch, self.forward(step, micro_batch, batches[micro_batch], sends)))
            if micro_batch >= warm_up(self.grid.stage, self.grid.stages, m):
                loss_sum += self.backward(step, *forwarded.popleft(), sends)
                self.set_aside(parts)
        with self.waiting("the stages' receipt of this step's sends"):
            self.grid.MPI.Request.Waitall(sends)
        grads = dict(zip(self.tied_names, gradients(self.state, self.tied_names, np)))
        for holders, names in self.tied_groups.items():
            for name in names:
                by_micro_batch = np.stack(parts[name])
                self.grid.tied[holders].allreduce_gradients([by_micro_batch])
                accumulated = by_micro_batch[0].copy()
                for part in by_micro_batch[1:]:  # as ORT accumulates a P = 1 run's micro-batches
                    accumulated += part
                grads[name][...] = accumulated
        self.sharding.sum_gradients()  # over the stage's copies: all of them, or each copy its run (train.zero 1)
        # The squares of each stage counted once (sharding.py's share of each copy), the loss from the
        # last stage, and every rank's stop votes: one all-reduce over all ranks.
        totals = np.array([self.sharding.share_of_squares(self.counted), loss_sum, *votes])
        with self.waiting("allreduce(metrics)"):  # where a stage that ends first waits for the others
            self.grid.world.Allreduce(self.grid.MPI.IN_PLACE, totals)
        scale_to_mean = 1.0 / (m * self.grid.copies_count)
        norm, loss = math.sqrt(totals[0]) * scale_to_mean, float(totals[1]) * scale_to_mean
        scale_and_clip(self.sharding.owned_gradients(), norm, scale_to_mean, cfg.clip_grad_norm)
        if math.isfinite(loss) and math.isfinite(norm):  # the same on every rank: both are sums over all of them
            self.optimizer.step(lr, self.optimizer_step, self.decay)
            self.sharding.gather()
        self.module.lazy_reset_grad()
        self.waits.append((self.waited, time.perf_counter() - started))
        return loss, norm, list(totals[2:])

    @contextlib.contextmanager
    def waiting(self, what: str):
        """A wait on other stages (the watchdog's scope `what`), its seconds counted in the step's."""
        started = time.perf_counter()
        with self.grid.watch(what):
            yield
        self.waited += time.perf_counter() - started

    def waited_share(self) -> float | None:
        """The share of this rank's steps it waited on other stages (the schedule's bubble, and
        any imbalance between the stages), over the steps after the first (which also warms up
        ONNX Runtime's sessions): None before a second step."""
        steady = self.waits[1:]
        return sum(w for w, _ in steady) / sum(s for _, s in steady) if steady else None

    def forward(self, step: int, micro_batch: int, batch: dict, sends: list) -> dict:
        """Micro-batch `micro_batch` forward: its activation received from the stage before,
        and (but on the last stage) its output sent to the stage after. Returns its feeds."""
        stage, shapes = self.stage, {name: value.shape for name, value in batch.items()}
        fed = dict(batch)
        if stage.input:
            fed[stage.input] = self.receive(stage.input, shapes, self.grid.stage - 1, micro_batch)
        if self.last:
            return fed
        upstream = f"{stage.output}{pipeline.UPSTREAM}"
        fed[upstream] = np.zeros(self.plan.shape(stage.output_shape, shapes), np.float32)
        self.module.eval()
        sent = self.run(step, micro_batch, fed | {pipeline.DROPOUT: np.array(True)})[stage.output]
        sends.append(self.grid.column.Isend(np.ascontiguousarray(sent), dest=self.grid.stage + 1, tag=micro_batch))
        return fed

    def backward(self, step: int, micro_batch: int, fed: dict, sends: list) -> float:
        """Micro-batch `micro_batch` backward (the training step): the gradient of the output
        received from the stage after (but on the last stage), that of the input sent to the
        stage before (but on the first). Returns the loss on the last stage, else 0."""
        stage = self.stage
        if not self.last:
            fed[f"{stage.output}{pipeline.UPSTREAM}"] = self.receive(
                stage.output, {name: value.shape for name, value in fed.items()}, self.grid.stage + 1, micro_batch)
        self.module.train()
        outputs = self.run(step, micro_batch, fed)
        if stage.input:
            sent = np.ascontiguousarray(outputs[f"{stage.input}{pipeline.GRADIENT}"])
            sends.append(self.grid.column.Isend(sent, dest=self.grid.stage - 1, tag=micro_batch))
        return float(outputs[self.module.output_names()[0]]) if self.last else 0.0

    def set_aside(self, parts: dict[str, list]) -> None:
        """Move the micro-batch's gradients of the tied weights out of ORT's accumulation buffers
        into `parts`, leaving zeros, to which the next micro-batch's add exactly."""
        for name, live in zip(self.tied_names, gradients(self.state, self.tied_names, np)):
            parts[name].append(live.copy())
            live[...] = 0

    def receive(self, activation: str, shapes: dict, source: int, micro_batch: int) -> np.ndarray:
        """The activation of the stage boundary `activation` (or its gradient: the same shape) from `source`."""
        boundary = next(s for s in self.plan.stages if s.output == activation)
        buffer = np.empty(self.plan.shape(boundary.output_shape, shapes), np.float32)
        with self.waiting(f"receive {activation} from stage {source}"):
            self.grid.column.Recv(buffer, source=source, tag=micro_batch)
        return buffer

    def run(self, step: int, micro_batch: int, fed: dict) -> dict:
        """The Module (in the mode set) on `fed`, seeded as a P = 1 run's rank seeds the micro-batch
        (this copy's), plus the Dropouts of the stages before: {output: value}."""
        seed_random_operators(self.seed, step, self.grid.copy, micro_batch, self.stage.dropouts_before)
        return self.named(self.call(fed))

    def named(self, outputs) -> dict:
        """The Module's `outputs` (in the mode set) by name."""
        return dict(zip(self.module.output_names(), outputs if isinstance(outputs, (list, tuple)) else [outputs]))

    def call(self, fed: dict):
        """The Module (in the mode set) on the inputs it takes of `fed`: its outputs as it returns them."""
        names = self.module.input_names()
        return self.module(*feeds_in_order(fed, names, self.info.label.name, self.data_label))

    def evaluate(self, reader: ShardReader, batch_size: int, records: int | None = None) -> dict:
        """The eval split (or `records` of it) through the stages with Dropout off, each copy
        reading the part a P = 1 run's rank of its index reads; the loss and metrics added up
        on the last stage (evaluation.Tally) and returned on every rank."""
        stage, tally = self.stage, Tally(reader, self.info, self.data_label)
        self.module.eval()
        for batch in reader.eval_batches(self.grid.copy, self.grid.copies_count, batch_size, records):
            shapes = {name: value.shape for name, value in batch.items()}
            fed = batch | {pipeline.DROPOUT: np.array(False)}
            if stage.input:
                fed[stage.input] = self.receive(stage.input, shapes, self.grid.stage - 1, 0)
            if self.last:
                tally.add(batch, self.call(fed))
                continue
            fed[f"{stage.output}{pipeline.UPSTREAM}"] = np.zeros(self.plan.shape(stage.output_shape, shapes),
                                                                  np.float32)
            sent = self.named(self.call(fed))[stage.output]
            # Blocking: the stages only send forward here, so no two wait on each other.
            self.grid.column.Send(np.ascontiguousarray(sent), dest=self.grid.stage + 1, tag=0)
        self.module.train()
        totals = tally.totals if self.last else np.zeros_like(tally.totals)
        with self.grid.watch("allreduce(evaluation)"):
            self.grid.world.Allreduce(self.grid.MPI.IN_PLACE, totals)
        return tally.results(totals)

    def checkpoint_slices(self) -> dict[str, tuple[int, int]]:
        """What this rank writes of a checkpoint, {parameter: (start, stop)}: its part of its
        stage's parameters (`layout`), but a tied weight only in the first stage that holds it,
        so that the shards cover each parameter once. Read together, they are the whole model's state."""
        return {name: piece for name, piece in self.layout[self.grid.copy].items()
                if self.plan.tied.get(name, [self.grid.stage])[0] == self.grid.stage}
