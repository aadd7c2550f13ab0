"""Which part of the trainable parameters each rank steps (train.zero), and the
communication that goes with it.

`train.zero: 0` (`Replicated`): every rank steps every parameter, with all of the
optimizer's moments: the gradients are all-reduced (gradients.py).

`train.zero: 1` (`ZeRO1`, the optimizer-state sharding of DeepSpeed's stage 1 and
ONNX Runtime's TrainingRunner): each rank owns the slices of the parameters that
it writes to a checkpoint (checkpoints.layout.cut, so a shard is exactly what a
rank owns) and holds the moments of those alone. Laid end to end in sorted name
order, the trainable parameters form one flat space in which each rank owns one
run. A step then
  1. reduce-scatters the gradients over that space, so each rank holds the sum
     of its own run (in buckets, like the all-reduce);
  2. measures the global norm from every rank's sum of squares of its run (one
     all-reduce of a number), and scales and clips its run as replication does;
  3. applies the weight decay and the optimizer to its run (optimizer.py);
  4. all-gathers the updated runs into every rank's live parameter buffers.
Sums of two ranks are the same in any order, and the optimizer is elementwise,
so only the norm's summation order differs from replication: after 50 steps of a
tiny GPT at W=2 the parameters differed by 0 (asserted: below 1e-6; tests/test_zero.py). ORT's Module
still holds every gradient, so what shrinks is the moments: with AdamW, about 3/4
of the parameters, gradients and moments of an unsharded rank at W=2.

With train.pipeline_stages P > 1, each stage's copies shard its parameters so
(pipeline_schedule.py), through the parts a step is made of (`sum_gradients`,
`share_of_squares`, `owned_gradients`, `gather`): the global norm there is summed
over every stage.
"""

from __future__ import annotations

import math

from ..checkpoints.layout import cut
from .gradients import BUCKET_BYTES, average_and_clip, gradients, parameters, scale_and_clip, sum_of_squares
from .optimizer import Piece, views


def layout(state, trainable: list[str], moments: int, world_size: int, xp) -> list[dict[str, tuple[int, int]]]:
    """Each rank's slices {parameter: (start, stop)} of every parameter of the live `state`."""
    names = [name for name, _ in state.parameters]
    return layout_of(dict(zip(names, parameters(state, names, xp))), trainable, moments, world_size)


def layout_of(arrays: dict, trainable: list[str], moments: int, world_size: int) -> list[dict[str, tuple[int, int]]]:
    """Each rank's slices of the parameters `arrays` (name -> array), as checkpoints
    cut them, each trainable one counted with its `moments`. Without a live state,
    bench/bench_train.py reads from it what a rank owns under train.zero 1."""
    trained = set(trainable)
    return cut({name: (array.size, array.nbytes * (1 + moments * (name in trained))) for name, array in arrays.items()},
               world_size)


class Replicated:
    """train.zero 0: this rank steps all of every trainable parameter."""

    def __init__(self, state, trainable: list[str], comm):
        self.state, self.trainable, self.comm = state, trainable, comm
        self.pieces = [Piece(name, 0, array.size)
                       for name, array in zip(trainable, parameters(state, trainable, comm.xp))]

    def average_and_clip(self, scale_to_mean: float, clip: float | None) -> float:
        return average_and_clip(self.comm, gradients(self.state, self.trainable, self.comm.xp), scale_to_mean, clip)

    # The three parts of a step that a pipeline stage (pipeline_schedule.py) interleaves with the
    # sums of its other communicators, where average_and_clip runs them together.
    def sum_gradients(self) -> None:
        """Sum the gradients across the communicator's ranks, in place."""
        self.comm.allreduce_gradients(gradients(self.state, self.trainable, self.comm.xp))

    def share_of_squares(self, names: list[str]) -> float:
        """This rank's part of the squared norm of the summed gradients of `names`: all of it on the
        communicator's first rank and none on the others, which hold the same sums."""
        return sum_of_squares(gradients(self.state, names, self.comm.xp), self.comm.xp) if self.comm.rank == 0 else 0.0

    def owned_gradients(self) -> list:
        """The gradients this rank steps: all of them."""
        return gradients(self.state, self.trainable, self.comm.xp)

    def gather(self) -> None:
        """Every rank stepped every parameter: nothing to gather."""


class ZeRO1:
    """train.zero 1: this rank steps its run of the flat space of the trainable parameters."""

    def __init__(self, state, trainable: list[str], comm, slices: list[dict[str, tuple[int, int]]]):
        self.state, self.comm, self.xp = state, comm, comm.xp
        self.names = sorted(trainable)
        owned = [sum(stop - start for name, (start, stop) in part.items() if name in self.names) for part in slices]
        self.bounds = [sum(owned[:rank]) for rank in range(comm.world_size + 1)]  # rank r owns [b[r], b[r+1])
        self.pieces = [Piece(name, *slices[comm.rank][name]) for name in self.names if name in slices[comm.rank]]
        arrays = parameters(state, self.names, self.xp)
        self.bucket = max(1, BUCKET_BYTES // max([a.itemsize for a in arrays] + [1]))  # elements
        dtype = arrays[0].dtype if arrays else "float32"
        self.whole, self.mine = self.xp.empty(self.bucket, dtype), self.xp.empty(self.bucket, dtype)

    def counts(self, a: int, b: int) -> list[int]:
        """How many elements of the flat range [a, b) each rank owns."""
        return [max(0, min(b, self.bounds[r + 1]) - max(a, self.bounds[r])) for r in range(self.comm.world_size)]

    def buckets(self):
        for a in range(0, self.bounds[-1], self.bucket):
            yield a, min(a + self.bucket, self.bounds[-1]), self.counts(a, a + self.bucket)

    def average_and_clip(self, scale_to_mean: float, clip: float | None) -> float:
        """Reduce-scatter the gradients; scale this rank's run to the mean and clip it to the
        global norm. Returns the norm before clipping, the same on every rank."""
        self.sum_gradients()
        norm = math.sqrt(self.comm.allreduce_sum([self.share_of_squares(self.names)])[0]) * scale_to_mean
        scale_and_clip(self.owned_gradients(), norm, scale_to_mean, clip)
        return norm

    def sum_gradients(self) -> None:
        """Reduce-scatter the gradients: this rank's run of them holds their sum across the communicator."""
        grads = [g.reshape(-1) for g in gradients(self.state, self.names, self.xp)]
        rank = self.comm.rank
        for a, b, counts in self.buckets():
            pack(grads, a, b, self.whole[:b - a])
            mine = self.mine[:counts[rank]]
            self.comm.reduce_scatter_flat(self.whole[:b - a], mine, counts)
            start = max(a, self.bounds[rank])
            unpack(grads, start, start + counts[rank], mine)

    def share_of_squares(self, names: list[str]) -> float:
        """This rank's part of the squared norm of the summed gradients of `names`: that of its run."""
        wanted = set(names)
        return sum_of_squares(views(self.state, [p for p in self.pieces if p.name in wanted], "grad", self.xp),
                              self.xp)

    def owned_gradients(self) -> list:
        """The gradients this rank steps: its run, as flat slices."""
        return views(self.state, self.pieces, "grad", self.xp)

    def gather(self) -> None:
        """Every rank's updated run into every rank's live parameter buffers."""
        params = [p.reshape(-1) for p in parameters(self.state, self.names, self.xp)]
        rank = self.comm.rank
        for a, b, counts in self.buckets():
            start = max(a, self.bounds[rank])
            mine = self.mine[:counts[rank]]
            pack(params, start, start + counts[rank], mine)
            self.comm.allgather_flat(mine, self.whole[:b - a], counts)
            unpack(params, a, b, self.whole[:b - a])


def segments(arrays: list, a: int, b: int):
    """(segment, at) for each part of the flat range [a, b) of the flat `arrays` laid end
    to end: `segment` is a view of one array, the elements from position `at` of the range."""
    offset = 0
    for array in arrays:
        lo, hi = max(a, offset), min(b, offset + array.size)
        if lo < hi:
            yield array[lo - offset:hi - offset], lo - a
        offset += array.size


def pack(arrays: list, a: int, b: int, flat) -> None:
    for segment, at in segments(arrays, a, b):
        flat[at:at + segment.size] = segment


def unpack(arrays: list, a: int, b: int, flat) -> None:
    for segment, at in segments(arrays, a, b):
        segment[...] = flat[at:at + segment.size]


def for_run(train, state, trainable: list[str], comm, slices: list[dict[str, tuple[int, int]]]):
    """The sharding of train.zero over the checkpoints' `slices` of each rank."""
    return ZeRO1(state, trainable, comm, slices) if train.zero else Replicated(state, trainable, comm)
