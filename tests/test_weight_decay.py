"""Weight decay in two groups (train.optimizer.no_decay): which parameters each
rule and pattern picks out, and a few steps of ortflow's training step (ORT's
AdamW or SGD graph and ortflow's decoupled decay, one rank, no MPI) against
torch.optim.AdamW and SGD with two parameter groups, stepping on ortflow's gradients
once they are shown equal to torch's, on a tiny GPT with biases, LayerNorms and embeddings."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from ortflow import config as config_mod
from ortflow.data.manifest import read_manifest
from ortflow.stages.prepare_data import prepare
from ortflow.data.shards import ShardReader
from ortflow.stages import build_artifacts
from ortflow.models import built_in
from ortflow.models.patterns import matches
from ortflow.errors import TrainingError
from ortflow.artifacts import Artifacts
from ortflow.training import engine, gradients, weight_decay
from ortflow.training.run_folder import TrainFolder
from ortflow.training.stop import StopRequest
from ortflow.training.trainer import Trainer
from ortflow.training.optimizer import Optimizer, Piece
from ortflow.training.weight_decay import WeightDecay

MODEL = {"kind": "gpt", "layers": 1, "heads": 2, "width": 8}
WEIGHT_DECAY = 0.1


def settings(optimizer: str = "adamw", **train) -> config_mod.Config:
    """The config, with train.optimizer.no_decay at its default (and the `train` keys given)."""
    return config_mod.load(overrides={
        "run": {"seed": 3}, "data": {"source": "text", "context": 8}, "model": MODEL,
        "train": {"optimizer": {"name": optimizer, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": WEIGHT_DECAY},
                  **train},
    })


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory) -> Path:
    """The train split of a short text."""
    root = tmp_path_factory.mktemp("decay")
    text = root / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    prepare(config_mod.load(overrides={"data": {"source": str(text), "context": 8}}), root / "train", root / "eval")
    return root / "train"


@pytest.fixture(scope="module")
def built(train_dir, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """{optimizer: (artifacts, model.json)} of the tiny GPT, with AdamW and with SGD."""
    found = {}
    for optimizer in ("adamw", "sgd"):
        out = tmp_path_factory.mktemp(optimizer) / "artifacts"
        found[optimizer] = out, build_artifacts.build(settings(optimizer), train_dir, out)
    return found


def test_default_rules_and_name_patterns():
    shapes = {"fc.weight": (4, 3), "fc.bias": (4,), "ln_f.weight": (3,), "wte.weight": (9, 3), "scale": ()}
    default = config_mod.load().train.optimizer.no_decay
    assert default == ("<1d>", "<embedding>")
    excluded = [n for n, s in shapes.items() if matches(n, len(s), {"wte.weight"}, default)]
    assert excluded == ["fc.bias", "ln_f.weight", "wte.weight", "scale"]
    # transformers' Trainer's names: a pattern matches a name containing it, ignoring case, with wildcards.
    hf = ["bias", "layernorm.weight"]
    assert matches("h.0.attn.c_attn.bias", 1, set(), hf)
    assert matches("embeddings.LayerNorm.weight", 1, set(), hf)
    assert not matches("h.0.mlp.c_fc.weight", 2, set(), hf)
    assert matches("blocks.3.norm2.weight", 2, set(), ["blocks.*.norm?"])
    assert not matches("fc.bias", 1, {"fc.bias"}, [])  # no_decay: [] decays everything, as one torch group


@pytest.mark.parametrize("no_decay, message", [
    ("bias", "config key 'train.optimizer.no_decay': 'bias' is not of type 'array'"),
    ([1], "config key 'train.optimizer.no_decay.0': 1 is not of type 'string'"),
    (["<2d>"], "config key 'train.optimizer.no_decay.0': '<2d>' is not allowed; expected a name pattern (a name "
               "containing it, ignoring case; wildcards * ? [...]) not starting with '<', or one of the rules <1d> "
               "and <embedding>"),
])
def test_a_bad_no_decay_entry_is_refused_in_one_line(no_decay, message):
    with pytest.raises(config_mod.ConfigError) as error:
        config_mod.load(overrides={"train": {"optimizer": {"no_decay": no_decay}}})
    assert str(error.value) == message


def test_artifacts_name_the_embedding_tables(built):
    _, description = built["adamw"]
    assert description.embeddings == ("tokens.weight", "positions.weight")


def open_training(artifacts: Path, description, name: str = "adamw"):
    """ORT's Module on the initial checkpoint, the optimizer's step, an Optimizer over every
    trainable parameter and the run's WeightDecay."""
    state = engine.initial_state(Artifacts(artifacts))
    module, step = engine.open_sessions(Artifacts(artifacts), state, "cpu", 1, settings(name).train.optimizer, np)
    module.train()
    names = engine.trainable(state)
    shapes = {parameter: state.parameters[parameter].data.shape for parameter in names}
    optimizer = Optimizer(state, [Piece(n, 0, int(np.prod(shapes[n]))) for n in names],
                          settings(name).train.optimizer, np)
    decay = WeightDecay(shapes, description.embeddings, settings(name).train.optimizer)
    return state, module, (optimizer, step), decay


def torch_training(train_dir: Path, state, decay: WeightDecay, optimizer: str):
    """The tiny GPT in torch with ORT's initial weights, and torch.optim.AdamW (or
    SGD) with two parameter groups: `decay.decayed` at WEIGHT_DECAY, the others at 0."""
    manifest = read_manifest(train_dir)
    model = built_in(settings().model, manifest, "cross_entropy")
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(torch.from_numpy(state.parameters[name].data))
    groups = [{"params": [parameters[n] for n in decay.decayed], "weight_decay": WEIGHT_DECAY},
              {"params": [parameters[n] for n in decay.not_decayed], "weight_decay": 0.0}]
    cfg = settings().train.optimizer
    if optimizer == "sgd":
        return model, parameters, torch.optim.SGD(groups, lr=RATES[0])
    return model, parameters, torch.optim.AdamW(groups, lr=RATES[0], betas=cfg.betas, eps=cfg.eps)


# Five steps at changing learning rates, as a schedule gives them.
RATES = [0.01, 0.02, 0.015, 0.005, 0.01]


@pytest.mark.parametrize("kind, tolerance", [("adamw", 1e-6), ("sgd", 1e-7)])
def test_training_steps_equal_torch_with_two_parameter_groups(built, train_dir, kind, tolerance, tmp_path):
    artifacts, description = built[kind]
    # ortflow's Trainer on one rank (this process), stepped by hand at the schedule's rates.
    config = settings(kind, world_size=1, micro_batch_size=8, clip_grad_norm=None)
    trainer = Trainer(config, train_dir, train_dir.parent / "eval", Artifacts(artifacts), TrainFolder(tmp_path),
                      StopRequest())
    state, decay = trainer.state, trainer.decay
    # The head is tied to the token embedding, which is an embedding table.
    assert sorted(decay.decayed) == ["blocks.0.attn.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.0.weight",
                                     "blocks.0.mlp.2.weight"]
    assert {"tokens.weight", "positions.weight", "ln_f.weight", "ln_f.bias", "blocks.0.mlp.0.bias"} <= set(
        decay.not_decayed)
    model, parameters, torch_optimizer = torch_training(train_dir, state, decay, kind)
    reader = ShardReader(train_dir)
    worst = 0.0
    for step, lr in enumerate(RATES):
        batch = reader.gather(np.arange(8 * step, 8 * step + 8))
        loss, _, _ = trainer.train_step(step, [batch], lr)
        torch_loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(batch["x"])), torch.from_numpy(batch["y"]))
        torch_optimizer.zero_grad()
        torch_loss.backward()
        # torch steps on ortflow's gradients (the step's, still in the state), once they are shown
        # equal to its own: AdamW moves an element by about lr whatever its gradient's size, so torch's
        # own gradients would make an element whose gradient is rounding noise (this GPT's key biases)
        # step apart by the CPU's summation order; the steps compared here are the optimizers' alone.
        for name, parameter in parameters.items():
            ours, theirs = state.parameters[name].grad, parameter.grad.numpy()
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6 * np.abs(theirs).max(), err_msg=name)
            parameter.grad = torch.from_numpy(ours.copy())
        for group in torch_optimizer.param_groups:
            group["lr"] = lr
        torch_optimizer.step()
        assert loss == pytest.approx(torch_loss.item(), rel=1e-5)
        for name, parameter in parameters.items():
            worst = max(worst, float(np.abs(state.parameters[name].data - parameter.detach().numpy()).max()))
    print(f"{kind}: largest |ortflow - torch| of a parameter over {len(RATES)} steps: {worst:.3g}")
    assert worst < tolerance


def test_with_zero_gradients_only_the_decayed_parameters_shrink_by_exactly_one_minus_lr_wd_per_step(built):
    artifacts, description = built["adamw"]
    state, module, optimizer, decay = open_training(artifacts, description)
    before = {name: state.parameters[name].data.copy() for name in engine.trainable(state)}  # .data is a live view
    module(*[np.zeros((2, 8), np.int64)] * 2)  # gradient buffers exist after a first backward
    factor = np.float32(1 - RATES[0] * WEIGHT_DECAY)  # torch rounds 1 - lr * wd to the parameters' dtype
    for _ in range(3):
        for g in gradients.gradients(state, engine.trainable(state), np):
            g[...] = 0.0  # Adam's update of a zero gradient is zero: what changes is the decay alone
        optimizer[0].step(RATES[0], optimizer[1], decay)
    cfg = settings().train.optimizer
    for name in decay.decayed:
        np.testing.assert_array_equal(state.parameters[name].data, before[name] * factor * factor * factor, name)
        reference = torch.nn.Parameter(torch.from_numpy(before[name]))
        torch_optimizer = torch.optim.AdamW([reference], lr=RATES[0], betas=cfg.betas, eps=cfg.eps,
                                            weight_decay=WEIGHT_DECAY)
        for _ in range(3):
            reference.grad = torch.zeros_like(reference)
            torch_optimizer.step()
        np.testing.assert_array_equal(state.parameters[name].data, reference.detach().numpy(), name)  # bit for bit
    for name in decay.not_decayed:
        np.testing.assert_array_equal(state.parameters[name].data, before[name], name)


def test_the_groups_are_logged_and_artifacts_without_embeddings_are_refused(built, caplog):
    from onnxruntime.training import api

    artifacts, description = built["adamw"]
    state = api.CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    optimizer = settings().train.optimizer
    with caplog.at_level(logging.INFO, logger="ortflow.train"):
        weight_decay.for_run(state, engine.trainable(state), description, optimizer, np)
    assert caplog.messages == [
        "weight decay 0.1 on 4 parameter tensors (blocks.0.attn.proj.weight, blocks.0.attn.qkv.weight, "
        "blocks.0.mlp.0.weight, blocks.0.mlp.2.weight); none on 12 (train.optimizer.no_decay: "
        "blocks.0.attn.proj.bias, blocks.0.attn.qkv.bias, blocks.0.ln1.bias, blocks.0.ln1.weight, ... (8 more))"]
    older = dataclasses.replace(description, embeddings=None)
    with pytest.raises(TrainingError) as error:
        weight_decay.for_run(state, engine.trainable(state), older, optimizer, np)
    assert str(error.value) == ("the artifacts' model.json names no embeddings (built by an older ortflow), which "
                                "train.optimizer.no_decay's <embedding> needs; rebuild them (--forcerun build_artifacts)")
