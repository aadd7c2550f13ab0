"""Token classification: labels per token, with -100 (IGNORE_INDEX, as in
transformers) where a position is no word's first token (padding, sub-tokens,
special tokens), which the loss and the metrics leave out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState, Module

from ortflow import cli
from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.data.shards import ShardReader
from ortflow.evaluation import batch_totals, eval_results, feeds, outputs_of
from ortflow.inference import loss_of
from ortflow.models import IGNORE_INDEX
from ortflow.training import gradients
from token_models import TokenTagger
from torch_reference import load_initial

VOCAB, TIME, CLASSES = 20, 10, 4
CONFIG = {
    "run": {"name": "tags", "seed": 3},
    "data": {"features": ["input_ids", "attention_mask", "token_type_ids"], "label": "tags", "eval_fraction": 0.25, "shards": 1},
    "model": {"kind": "torch", "path": "token_models:TokenTagger", "kwargs": {"vocab_size": VOCAB, "classes": CLASSES}},
    "train": {"world_size": 1, "micro_batch_size": 16},
}
# float32 in both, summed in other orders: measured 0 (loss) and 1.0e-7 (gradients, head.weight)
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def tagged(tmp_path_factory) -> Path:
    """Token ids padded with 0 after a random length, tags -100 on the padding and
    on every third token (as a sub-token would be); prepared and built as the
    workflow's rules do (in this process: neither runs snakemake nor mpirun)."""
    root = tmp_path_factory.mktemp("tagged")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (64, TIME))
    tags = ids % CLASSES
    lengths = rng.integers(3, TIME + 1, len(ids))
    padding = np.arange(TIME)[None, :] >= lengths[:, None]
    ids[padding] = 0
    tags[padding | (np.arange(TIME)[None, :] % 3 == 2)] = IGNORE_INDEX
    np.savez(root / "tagged.npz", input_ids=ids, attention_mask=(~padding).astype(np.int64),
             token_type_ids=np.zeros_like(ids), tags=tags)
    config = json.dumps({**CONFIG, "data": {**CONFIG["data"], "source": str(root / "tagged.npz")}})
    data = ["--train", str(root / "data/train"), "--eval", str(root / "data/eval")]
    assert cli.main(["prepare-data", "--config-json", config, *data]) == 0
    assert cli.main(["build-artifacts", "--config-json", config, "--train", str(root / "data/train"),
                     "--out", str(root / "artifacts")]) == 0
    return root


def test_loss_gradients_and_accuracy_leave_ignored_positions_out_as_torch_does(tagged):
    reader = ShardReader(tagged / "data/train")
    assert reader.manifest["num_classes"] == CLASSES
    batch = reader.gather(np.arange(16))
    labels = batch["tags"]
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()

    artifacts = Artifacts(tagged / "artifacts")
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    module = Module(str(artifacts.training_model), state, str(artifacts.eval_model))
    module.train()
    loss, logits = outputs_of(module(*feeds(batch, module.input_names(), "tags", "tags")))
    reference = load_initial(TokenTagger(VOCAB, CLASSES), tagged / "artifacts")
    torch_logits = reference(*(torch.from_numpy(batch[name]) for name in CONFIG["data"]["features"]))
    torch_loss = torch.nn.functional.cross_entropy(torch_logits, torch.from_numpy(labels), ignore_index=-100)
    torch_loss.backward()
    assert abs(loss - torch_loss.item()) <= TOLERANCE, (loss, torch_loss.item())
    # Ignoring changes the figure: the mean over every position would be another loss.
    everything = torch.nn.functional.cross_entropy(torch_logits, torch.from_numpy(np.maximum(labels, 0)))
    assert abs(loss - everything.item()) > 100 * TOLERANCE
    names = [name for name, _ in reference.named_parameters()]
    for name, ours in zip(names, gradients.gradients(state, names, np)):
        theirs = dict(reference.named_parameters())[name].grad.numpy()
        assert np.abs(np.asarray(ours) - theirs).max() <= TOLERANCE, name

    # Evaluation: accuracy and per-class counts over the labelled positions only.
    module.eval()
    loss, logits = outputs_of(module(*feeds(batch, module.input_names(), "tags", "tags")))
    kept = labels != IGNORE_INDEX
    predicted = logits.argmax(axis=1)
    info = {"task": "classification", "loss": "cross_entropy"}
    results = eval_results(batch_totals(loss, logits, labels, info, CLASSES), "classification",
                           [str(c) for c in range(CLASSES)])
    assert results["accuracy"] == pytest.approx((predicted[kept] == labels[kept]).mean())
    assert results["loss"] == pytest.approx(loss)
    assert loss_of(logits, labels, "cross_entropy") == pytest.approx(loss, rel=1e-6)  # export's and quantize's
    assert sum(c["count"] for c in results["per_class"].values()) == kept.sum()


def test_a_negative_class_other_than_the_ignored_index_is_refused(tmp_path):
    from ortflow.data import sources
    from ortflow.errors import DataError

    np.savez(tmp_path / "tagged.npz", input_ids=np.ones((4, 3), np.int64),
             tags=np.array([[0, 1, -100], [1, 0, -1], [0, 1, 1], [1, 0, 0]]))
    config = config_mod.load(overrides={"data": {"source": str(tmp_path / "tagged.npz"), "features": ["input_ids"],
                                                 "label": "tags"}})
    with pytest.raises(DataError, match=r"label 'tags' has negative class -1; classes are 0..K-1 \(-100 marks a "
                                        r"position the loss ignores\)"):
        sources.load(config.data)
