"""Weight decay in two groups, as transformers' Trainer and nanoGPT apply it and as
torch.optim.AdamW computes it with two parameter groups: `train.optimizer.weight_decay`
on the decayed parameters, none on those `train.optimizer.no_decay` picks out
(by default biases, norm scales and shifts, and embeddings; its entries: models/patterns.py).

Why training applies it and not ONNX Runtime's optimizer graph: ORT's
AdamWOptimizer operator has one `weight_decay` attribute for the whole sequence
of parameters it updates, and the training API's Optimizer runs one such graph
over every trainable parameter (its checkpoint holds one optimizer group). So
the optimizer graph is built with weight decay 0 (graphs/generate.py) and every
rank decays the parameters itself, in torch's order (torch.optim.adamw,
_single_tensor_adamw): `p *= 1 - lr * weight_decay` with the step's scheduled
lr, after the gradients are final and before the optimizer step, which then
applies Adam's update (that update reads the gradient and the moments, not p).
Elementwise, it applies to whole parameters or, under train.zero 1, to the slices
a rank owns (training/optimizer.py).
The decay is a function of the step alone, so a resumed run stays bit-identical.
Measured against torch.optim.AdamW with two groups (tests/test_weight_decay.py,
a tiny GPT): the decay alone is bit for bit torch's; after five AdamW steps at
changing learning rates no parameter differs by more than 1.7e-7 (asserted: 1e-6).

For SGD, whose ORT graph has no weight decay at all, this is torch.optim.SGD's
`weight_decay` without momentum: p - lr (g + wd p) = p (1 - lr wd) - lr g
(five steps differ from torch's by at most 1.1e-8, asserted: 1e-7).

For LAMB the decay is part of the update direction, inside the trust ratio
(lamb.py): `apply` leaves the weights alone, and `per_tensor` gives LAMB each
tensor's decay, by the same two groups.
"""

from __future__ import annotations

import logging

from ..errors import TrainingError
from ..models.patterns import EMBEDDING, matches
from .gradients import parameters

log = logging.getLogger("ortflow.train")

class WeightDecay:
    """The two groups of one run's trainable parameters, and the decay of each step."""

    def __init__(self, shapes: dict[str, tuple], embeddings: list[str], optimizer):
        """`shapes`: the trainable parameters' shapes, by name; `embeddings`: the
        parameters that an embedding lookup reads (model.json); `optimizer`: train.optimizer."""
        self.weight_decay = optimizer.weight_decay
        self.inside_optimizer = optimizer.name == "lamb"  # LAMB decays inside its trust ratio (lamb.py)
        excluded = {name for name, shape in shapes.items()
                    if matches(name, len(shape), set(embeddings), optimizer.no_decay)}
        self.decayed = [name for name in shapes if name not in excluded]
        self.not_decayed = [name for name in shapes if name in excluded]
        self.decayed_set = set(self.decayed)

    def describe(self, shown: int = 4) -> str:
        """One log line: how many parameter tensors are decayed, and a few names of each group."""
        def few(names: list[str]) -> str:
            return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")

        where = " (inside LAMB's update)" if self.inside_optimizer else ""
        return (f"weight decay {self.weight_decay}{where} on {len(self.decayed)} parameter tensors ({few(self.decayed)}); "
                f"none on {len(self.not_decayed)} (train.optimizer.no_decay: {few(self.not_decayed)})")

    def per_tensor(self, names: list[str]) -> list[float]:
        """The decay of each parameter `names` names, in that order: LAMB's `weight_decays`."""
        return [self.weight_decay if name in self.decayed_set else 0.0 for name in names]

    def apply(self, lr: float, names: list[str], arrays: list) -> None:
        """p *= 1 - lr * weight_decay on the `arrays` (views of ORT's live buffers: whole
        parameters or slices) of the decayed parameters among `names`, as torch does
        before Adam's update (training/optimizer.py calls it); nothing for LAMB, whose
        update decays them."""
        if not self.weight_decay or self.inside_optimizer:
            return
        factor = 1.0 - lr * self.weight_decay  # in double, as torch; the multiply rounds it to the parameters' dtype
        for name, array in zip(names, arrays):
            if name in self.decayed_set:
                array *= factor


def for_run(state, names: list[str], info, optimizer, xp) -> WeightDecay:
    """The groups of the trainable parameters `names` of a live CheckpointState,
    with the embedding tables that model.json (`info`) names, logged."""
    if EMBEDDING in optimizer.no_decay and info.embeddings is None:
        raise TrainingError("the artifacts' model.json names no embeddings (built by an older ortflow), which "
                            "train.optimizer.no_decay's <embedding> needs; rebuild them (--forcerun build_artifacts)")
    arrays = parameters(state, names, xp)
    decay = WeightDecay({name: tuple(array.shape) for name, array in zip(names, arrays)}, info.embeddings or (),
                        optimizer)
    log.info("%s", decay.describe())  # rank 0's: the other ranks log warnings only
    return decay
