"""The layers of real models, each in a user torch module (tests/torch_layers.py:
int64 token ids -> nn.Embedding -> the layer -> mean -> linear head), through
ortflow's own stage commands (`ortflow build-artifacts`, `ortflow train -n 1`,
`ortflow checkpoint merge`, `ortflow export-model`): a short training equals the
same training in PyTorch (tests/torch_reference.py: same initial weights, same
batches, SGD, clipping, schedule), and the exported model equals the eval graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState, Module

from ortflow import cli
from ortflow.checkpoints import reader
from ortflow.artifacts import Artifacts
from ortflow import config as config_mod
from ortflow.data.shards import ShardReader
from ortflow.errors import ModelError
from ortflow.evaluation import feeds, outputs_of
from ortflow.training.run_folder import TrainFolder
from ortflow.models import torch_export
from ortflow.sessions import inference_session
from conftest import shard_manifest
from torch_layers import LayerNet
from torch_reference import load_initial, train_like_ortflow, with_weights

LAYERS = ["embedding", "embedding_padding_idx", "layer_norm", "gelu", "gelu_tanh", "sdpa_causal", "sdpa_mask",
          "multihead_attention", "transformer_encoder_layer"]
VOCAB, TIME = 16, 8
# weight_decay 0: the comparison is about the layers (tests/test_weight_decay.py
# compares the weight decay's parameter groups with torch's). Plain SGD, not AdamW: SGD moves a
# weight by lr x its gradient, so the trainings part by the gradients' rounding alone. AdamW moves
# each element by about lr whatever its gradient's size: an attention's key bias, whose gradient is
# zero but for rounding, moved by up to 2.5e-3 in other directions in ONNX Runtime and torch, so a
# bound on AdamW's weights lets the CPU's summation order decide (tests/torch_reference.py).
CONFIG = {
    "run": {"name": "layers", "seed": 7},
    "data": {"features": ["ids"], "label": "y", "eval_fraction": 0.2, "shards": 1},
    "train": {"world_size": 1, "micro_batch_size": 16, "steps": 8, "log_every": 1, "eval_every": 8,
              "checkpoint_every": 8, "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0},
              "lr_schedule": {"name": "cosine", "warmup_steps": 2}},
}
# Allowed differences, float32 in both (ONNX Runtime sums in other orders than
# torch), with the largest measured over the layers above (the same in each of
# several runs here: both are deterministic on one machine):
LOSS_TOLERANCE = 1e-6  # the loss of each step: measured 2.4e-7 (gelu)
PARAMETER_TOLERANCE = 5e-6  # final weights: measured 6.7e-7 (multihead_attention)
# exported logits vs the eval graph's: measured 0 (bit for bit); vs torch's eval mode: 1.2e-7
EXPORT_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """Token ids (0 is padding, never first) and three classes, as shards (`ortflow prepare-data`)."""
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (160, TIME))
    ids[:, 0] = rng.integers(1, VOCAB, len(ids))
    np.savez(root / "tokens.npz", ids=ids, y=(ids < 5).sum(1) % 3)
    config = json.dumps({**CONFIG, "data": {**CONFIG["data"], "source": str(root / "tokens.npz")}})
    assert cli.main(["prepare-data", "--config-json", config, "--train", str(root / "data/train"),
                     "--eval", str(root / "data/eval")]) == 0
    return root / "data"


def run_ortflow(config: config_mod.Config, data: Path, out: Path) -> None:
    """build_artifacts, train, merge_checkpoint and export_model as the workflow's
    rules run them; `ortflow train` in a process of its own, because it takes
    over SIGINT and SIGTERM to pass them on to its ranks."""
    arguments, artifacts = ["--config-json", json.dumps(config_mod.as_dict(config))], str(out / "artifacts")
    assert cli.main(["build-artifacts", *arguments, "--train", str(data / "train"), "--out", artifacts]) == 0
    train = subprocess.run(
        [sys.executable, "-m", "ortflow.cli", "train", "-n", "1", *arguments, "--train", str(data / "train"),
         "--eval", str(data / "eval"), "--artifacts", artifacts, "--out", str(out / "train")],
        capture_output=True, text=True,
    )
    assert train.returncode == 0, train.stderr[-4000:]
    assert cli.main(["checkpoint", "merge", str(TrainFolder(out / "train").checkpoints), str(out / "checkpoint"), "--artifacts",
                     artifacts, *arguments]) == 0
    assert cli.main(["export-model", *arguments, "--artifacts", artifacts, "--checkpoint", str(out / "checkpoint"),
                     "--eval", str(data / "eval"), "--out", str(out / "model.onnx")]) == 0


def largest(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def torch_logits(layer: str, weights: dict, ids: np.ndarray) -> np.ndarray:
    """The torch module's logits in eval mode with `weights`."""
    with torch.no_grad():
        return with_weights(LayerNet(layer), weights).eval()(torch.from_numpy(ids)).numpy()


def eval_logits(out: Path, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """(exported model's, eval graph's) logits of `batch`, both with the merged checkpoint's weights."""
    exported = inference_session(out / "model.onnx").run(None, {"ids": batch["ids"]})[0]
    artifacts = Artifacts(out / "artifacts")
    state = CheckpointState.load_checkpoint(str(out / "checkpoint/checkpoint"))
    module = Module(str(artifacts.training_model), state, str(artifacts.eval_model))
    module.eval()
    return exported, outputs_of(module(*feeds(batch, module.input_names(), "y", "y")))[1]


@pytest.mark.e2e
@pytest.mark.parametrize("layer", LAYERS)
def test_short_training_equals_pytorch_and_export_equals_eval_graph(layer, tokens, tmp_path):
    model = {"kind": "torch", "path": "torch_layers:LayerNet", "kwargs": {"layer": layer}}
    config = config_mod.load(overrides={**CONFIG, "data": {**CONFIG["data"], "source": "tokens.npz"}, "model": model})
    run_ortflow(config, tokens, tmp_path)
    history = json.loads((tmp_path / "train/metrics.json").read_text())["history"]["train"]
    losses = [entry["loss"] for entry in history]
    trained = reader.load_parameters_file(tmp_path / "checkpoint/checkpoint")
    torch_losses, torch_trained = train_like_ortflow(load_initial(LayerNet(layer), tmp_path / "artifacts"), config,
                                                     tokens / "train")
    assert len(losses) == len(torch_losses) == config.train.steps
    assert largest(losses, torch_losses) <= LOSS_TOLERANCE, (losses, torch_losses)
    assert trained.keys() == torch_trained.keys()
    worst = {name: largest(trained[name], torch_trained[name]) for name in trained}
    assert max(worst.values()) <= PARAMETER_TOLERANCE, worst

    eval_reader = ShardReader(tokens / "eval")
    batch = eval_reader.gather(np.arange(len(eval_reader)))
    exported, graph = eval_logits(tmp_path, batch)
    in_torch = torch_logits(layer, trained, batch["ids"])
    print(f"{layer}: loss {largest(losses, torch_losses):.2g}, parameters {max(worst.values()):.2g}, exported vs "
          f"eval graph {largest(exported, graph):.2g}, vs torch {largest(exported, in_torch):.2g}")
    assert largest(exported, graph) <= EXPORT_TOLERANCE
    assert largest(exported, in_torch) <= EXPORT_TOLERANCE


class Bag(torch.nn.Module):
    """Mean of token embeddings; `functional` calls F.embedding on its own weight."""

    def __init__(self, functional: bool = False, **embedding):
        super().__init__()
        self.embed, self.functional = torch.nn.Embedding(VOCAB, 4, **embedding), functional

    def forward(self, ids):
        if self.functional:
            return torch.nn.functional.embedding(ids, self.embed.weight, scale_grad_by_freq=True).mean(1)
        return self.embed(ids).mean(1)


@pytest.mark.parametrize("module, message", [
    (lambda: Bag(scale_grad_by_freq=True), "model.path: Bag.embed (nn.Embedding) has scale_grad_by_freq=True, "
     "which ONNX cannot express (it scales each token's gradient by its frequency in the batch); "
     "set scale_grad_by_freq=False"),
    (lambda: Bag(functional=True), "model.path: torch.onnx cannot export Bag: embedding with scale_grad_by_freq=True: "
     "ONNX cannot scale the gradients by the tokens' frequency; set scale_grad_by_freq=False"),
], ids=["scale_grad_by_freq", "functional_scale_grad_by_freq"])
def test_embedding_that_cannot_train_as_in_torch_is_refused_in_one_line(module, message, tmp_path):
    with pytest.raises(ModelError) as error:
        torch_export.export_torch(module(), shard_manifest([("ids", "int64", [TIME])]), tmp_path / "model.onnx")
    assert str(error.value) == message
