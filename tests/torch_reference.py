"""ortflow's training done again in plain single-process PyTorch, to compare with
(tests/test_train.py, tests/test_torch_layers.py): the same initial weights (the
build_artifacts checkpoint), the same global batches, torch.optim.AdamW (or SGD without
momentum) with the config's optimizer, clipping to the global gradient norm, ortflow's schedule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ortflow.checkpoints import reader
from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.data.shards import ShardReader
from ortflow.training.schedule import learning_rate


# AdamW moves each element by about the learning rate whatever its gradient's size, so the two
# float32 trainings' rounding, relative to each element's gradient, shows in its step: a fixed bound
# on the weights lets the CPU's summation order decide. update_ratios bounds each element by its own
# move in torch instead: ortflow's weight within UPDATE_RTOL of that move, plus UPDATE_ATOL for the
# elements that barely move. Where a gradient is zero in exact arithmetic (rounding noise alone: an
# attention's key bias) no bound on AdamW's weights holds; such models are compared after SGD steps.
UPDATE_RTOL = 1e-3
UPDATE_ATOL = 1e-7


def update_ratios(trained: dict, reference: dict, initial: dict) -> dict[str, float]:
    """{name: the largest |trained - reference| / (UPDATE_RTOL * |reference - initial| + UPDATE_ATOL)
    of its elements}: at most 1 where ortflow's AdamW steps are torch's to within rounding."""
    ratios = {}
    for name, array in trained.items():
        ours, theirs = np.asarray(array, np.float64), np.asarray(reference[name], np.float64)
        moved = np.abs(theirs - np.asarray(initial[name], np.float64).reshape(theirs.shape))
        ratios[name] = float((np.abs(ours.reshape(theirs.shape) - theirs) / (UPDATE_RTOL * moved + UPDATE_ATOL)).max())
    return ratios


def with_weights(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> torch.nn.Module:
    """`model` with `weights` (every parameter, strictly)."""
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return model


def load_initial(model: torch.nn.Module, artifacts: Path) -> torch.nn.Module:
    """`model` with the weights of ortflow's initial checkpoint."""
    return with_weights(model, reader.load_parameters_file(Artifacts(artifacts).checkpoint))


def train_like_ortflow(model: torch.nn.Module, config: dict, train_dir: Path,
                       groups: list[dict] | None = None, autocast: bool = False,
                       order=lambda indices: indices) -> tuple[list[float], dict]:
    """Train `model` (features in, logits out, cross-entropy) as ortflow trains
    with `config`; return the loss of each step and the final parameters.
    `groups`: the optimizer's parameter groups (each with its weight_decay), by default
    one group of every parameter with the config's weight decay. `autocast`: the forward
    under torch.autocast("cpu", dtype=torch.bfloat16). `order`: the batch's records in
    another order (the same mean loss and gradients, summed in another order)."""
    train, opt = config.train, config.train.optimizer
    if opt.name == "sgd":
        optimizer = torch.optim.SGD(groups or model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    else:
        optimizer = torch.optim.AdamW(groups or model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                      eps=opt.eps, weight_decay=opt.weight_decay)
    reader = ShardReader(train_dir)
    features = [f.name for f in reader.manifest.features]
    losses = []
    for step in range(train.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, train.steps, opt.lr, train.lr_schedule)
        indices = reader.global_batch(step, config.run.seed, config_mod.global_batch_size(config))
        batch = reader.gather(order(np.sort(indices)))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(*(torch.from_numpy(batch[name]) for name in features))
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(batch[reader.label_name]))
        optimizer.zero_grad()
        loss.backward()
        if train.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in model.state_dict().items()}
