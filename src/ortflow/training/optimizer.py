"""The optimizer step, run by ortflow over arrays it holds.

ONNX Runtime's training API keeps the optimizer's moments inside its
CheckpointState and steps every trainable parameter at once, so a rank could
neither own part of the optimizer state (ZeRO-1) nor save it without ORT writing
its whole checkpoint file. ortflow runs ORT's own optimizer graph instead (the
artifacts' optimizer_model.onnx: AdamW as torch computes it, or SGD) in an
InferenceSession, over arrays it chooses:

  - parameters and gradients: views of ORT's live buffers (gradients.py), the
    whole tensors, or under train.zero 1 the flat slices this rank owns (sharding.py);
  - the moments of those same slices, held here (AdamW: momentum0 and momentum1;
    SGD: momentum0, which its graph takes and ignores, kept for the checkpoint format).

The graph's kernel updates the arrays of its sequences in place. That is checked
once (`GraphStep`): a copy made on the way in would lose the update without a
sound. Its arithmetic is elementwise, so a slice steps as the whole does, bit for
bit where it is cut at a multiple of 16 elements; elsewhere, an element at its ends can land
one unit in the last place apart (the kernel steps a tensor's body in vector
packets and the rest one by one, which round differently). Measured against the
training API's Optimizer over the same model (tests/test_optimizer.py) it is bit
for bit the same, AdamW and SGD, several steps: so this is the one optimizer path,
and the training API's Optimizer is not used.

Another optimizer plugs in by `train.optimizer.name` in open_step: an object called as
`step(lr, step, params, grads, moments, decays)` that updates `params` and `moments`
(one list of arrays per name of MOMENTS, in order) in place. `decays` is each
tensor's weight decay, for an optimizer that decays inside its update: LAMB
(LambStep), which ONNX Runtime has no CPU kernel for. ORT's graphs ignore it: their
decay is applied before them (weight_decay.py), as torch does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy

from ..checkpoints.checks import MOMENTS
from ..errors import TrainingError
from .gradients import gradients, on_host, parameters
from .lamb import Lamb

# ORT's optimizer graphs name their sequences of moments so, in the order of the sorted MOMENTS.
GRAPH_MOMENTS = ("first_order_moments", "second_order_moments")
GROUP = "group0"  # the one optimizer group's name, as ONNX Runtime's checkpoints give it


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened trainable parameter `name`."""

    name: str
    start: int
    stop: int


class GraphStep:
    """ORT's optimizer graph in an InferenceSession. On CUDA (`xp` cupy) the arrays go
    through the host: ONNX Runtime's Python API binds no sequence of device buffers."""

    checked = False  # whether this process has seen a step update its arrays in place

    def __init__(self, path: Path, options, xp):
        import onnxruntime

        self.xp = xp
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        if not GraphStep.checked:  # once: the sessions reopened to profile steps would trace it
            self.check_in_place()
            GraphStep.checked = True

    def __call__(self, lr: float, step: int, params: list, grads: list, moments: list[list],
                 decays: list[float] | None = None) -> None:
        on_host = self.xp is not numpy
        host = [[a.get() for a in arrays] if on_host else arrays for arrays in (params, grads, *moments)]
        feeds = {"learning_rate": numpy.array([lr], numpy.float32), "step": numpy.array([step], numpy.int64),
                 "params": host[0], "gradients": host[1], **dict(zip(GRAPH_MOMENTS, host[2:]))}
        self.session.run(None, {name: value for name, value in feeds.items() if name in self.inputs})
        if on_host:
            for device, updated in zip([*params, *(a for arrays in moments for a in arrays)],
                                       [*host[0], *(a for arrays in host[2:] for a in arrays)]):
                device.set(updated)

    def check_in_place(self) -> None:
        """One step on a parameter of one element: ONNX Runtime must have changed it where it lies."""
        param = numpy.ones(1, numpy.float32)
        moments = [[numpy.zeros(1, numpy.float32)] for name in GRAPH_MOMENTS if name in self.inputs]
        self(0.5, 1, [param], [numpy.ones(1, numpy.float32)], moments)
        if param[0] == 1.0:
            import onnxruntime

            raise TrainingError(f"onnxruntime {onnxruntime.__version__} did not update the parameters given to its "
                                "optimizer graph in place (ortflow steps ORT's live buffers through it): install "
                                "the onnxruntime-training version pyproject.toml pins")


def views(state, pieces: list[Piece], which: str, xp) -> list:
    """The live `data` or `grad` buffers of the `pieces`, as flat slices."""
    live = {"data": parameters, "grad": gradients}[which](state, [p.name for p in pieces], xp)
    return [array.reshape(-1)[p.start:p.stop] for p, array in zip(pieces, live)]


class LambStep:
    """LAMB (lamb.py), computed with `xp` over whole tensors (train.zero 1 is refused with it)."""

    def __init__(self, optimizer, xp):
        self.betas, self.eps, self.xp = tuple(optimizer.betas), optimizer.eps, xp

    def __call__(self, lr: float, step: int, params: list, grads: list, moments: list[list],
                 decays: list[float] | None = None) -> None:
        Lamb(self.betas, self.eps, decays, self.xp).step(lr, step, params, grads, *moments)


def open_step(optimizer, path: Path, options, xp):
    """The step of train.optimizer `optimizer`: ORT's graph in the artifacts (AdamW, SGD), or LAMB."""
    if optimizer.name == "lamb":
        return LambStep(optimizer, xp)
    return GraphStep(path, options, xp)


class Optimizer:
    """The optimizer state of the `pieces` of the trainable parameters that this rank
    steps (training/sharding.py says which), and the step over them."""

    def __init__(self, state, pieces: list[Piece], optimizer, xp):
        self.state, self.pieces, self.xp = state, pieces, xp
        self.initial_lr = optimizer.lr
        self.moment_names = sorted(MOMENTS[optimizer.name])
        params = views(state, pieces, "data", xp)
        self.moments = {m: {p.name: xp.zeros_like(v) for p, v in zip(pieces, params)} for m in self.moment_names}
        self.count = 0  # steps taken: ORT's optimizer graph takes the count including the step it takes

    def step(self, lr: float, run, decay) -> None:
        """The weight decay (`decay`) then the optimizer's update (`run`, a step of
        open_step) of the pieces, at learning rate `lr`, in ORT's live buffers."""
        self.count += 1
        if not self.pieces:  # a rank that owns none of a tiny model's parameters
            return
        params, names = views(self.state, self.pieces, "data", self.xp), [p.name for p in self.pieces]
        decay.apply(lr, names, params)
        run(lr, self.count, params, views(self.state, self.pieces, "grad", self.xp),
            [[self.moments[m][p.name] for p in self.pieces] for m in self.moment_names], decay.per_tensor(names))

    def attributes(self) -> dict:
        """The optimizer group's scalars, as ONNX Runtime's checkpoint holds them."""
        # ORT's checkpoint holds the rate as a float32: the same number here, so that a merged
        # checkpoint (written in ORT's format) and its shards agree.
        return {"group_name": GROUP, "step": self.count, "initial_learning_rate": float(numpy.float32(self.initial_lr))}

    def moments_of(self, name: str, start: int, stop: int) -> dict:
        """{moment: elements [start, stop) of parameter `name`'s}, which this rank holds, on the host."""
        piece = next(p for p in self.pieces if p.name == name)
        if not piece.start <= start <= stop <= piece.stop:
            raise ValueError(f"{name}[{start}:{stop}] is not within this rank's {piece}")
        return {m: on_host(self.moments[m][name][start - piece.start:stop - piece.start], self.xp)
                for m in self.moment_names}

    def load(self, group: dict, moments: dict[str, dict]) -> None:
        """The state of a checkpoint: its optimizer `group`'s scalars and {parameter: {moment: whole array}}."""
        self.count = group["step"]
        for p in self.pieces:
            for m in self.moment_names:
                self.moments[m][p.name][...] = self.xp.asarray(moments[p.name][m].reshape(-1)[p.start:p.stop])
