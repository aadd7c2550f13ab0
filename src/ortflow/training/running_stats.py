"""BatchNorm's running statistics during training (see models/batchnorm.py).

The training graph returns each BatchNorm's running mean and variance updated
as torch updates them in train mode (`model.json` `running_stats`: graph output
-> parameter). After every forward (every micro-batch, as torch updates them on
every forward) `keep` copies them into their non-trainable parameters in the
checkpoint state, in place, which the next forward, the eval graph, checkpoints
and so the export read.

Across ranks, each rank has updated them with its own micro-batches; at the end
of the step they are replaced by their mean over the ranks. PyTorch DDP instead
broadcasts rank 0's buffers before each forward, which throws away what the
other ranks saw: the mean keeps every rank's batches in the estimate (the running
mean then moves towards the mean of the whole global batch), equals torch's
exactly on one rank, and is identical on every rank (one Allreduce gives every
rank the same sums), so every shard of a checkpoint agrees. It costs no
collective of its own: the values ride along with the loss's all-reduce.
"""

from __future__ import annotations

import numpy as np

from .gradients import on_host, parameters


class RunningStats:
    def __init__(self, state, output_names: list[str], stats: dict[str, str], comm):
        self.state, self.xp, self.world_size = state, comm.xp, comm.world_size
        # (position among the Module's training outputs, parameter)
        self.outputs = [(output_names.index(output), parameter) for output, parameter in stats.items()]

    def _live(self) -> list:
        """The parameters' own buffers (ORT keeps them in the state; looked up each time, which is cheap)."""
        return parameters(self.state, [parameter for _, parameter in self.outputs], self.xp)

    def keep(self, outputs) -> None:
        """Copy the updated statistics of one forward's `outputs` into their parameters."""
        if not self.outputs:
            return
        for (position, _), live in zip(self.outputs, self._live()):
            live[...] = self.xp.asarray(outputs[position])

    def local(self) -> np.ndarray:
        """This rank's statistics, flat, as float64 (to be summed across ranks; none on one rank)."""
        if self.world_size == 1 or not self.outputs:
            return np.zeros(0)
        return np.concatenate([on_host(live, self.xp).reshape(-1) for live in self._live()]).astype(np.float64)

    def set_mean(self, summed: np.ndarray) -> None:
        """Replace the statistics by `summed` (`local` summed over the ranks) / world_size."""
        if not summed.size:
            return
        offset = 0
        for live in self._live():
            part = summed[offset:offset + live.size].reshape(live.shape) / self.world_size
            live[...] = self.xp.asarray(part.astype(live.dtype))
            offset += live.size
