"""Hugging Face transformers models with their default attention (sdpa),
randomly initialised from a config (nothing downloaded), through the real
workflow as `model.kind: torch` with the thin wrappers of
tests/transformers_models.py: GPT-2 as a language model on `data.source: text`
and BERT for sequence classification on integer token ids. Also the export
repairs they need (ortflow.models.export_fixes), each against torch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from conftest import gate_judged, run_snakemake, shard_manifest
from ortflow.errors import ModelError
from ortflow.graphs import cost, generate
from ortflow.models import torch_export

TESTS = Path(__file__).resolve().parent
FEATURE = [{"name": "x", "dtype": "float32", "shape": [6]}]


def _export(module, features, tmp_path) -> onnx.ModelProto:
    path = tmp_path / "model.onnx"
    torch_export.export_torch(module, shard_manifest([(f["name"], f["dtype"], f["shape"]) for f in features]), path)
    return onnx.load(str(path))


class DiffAndCumsum(torch.nn.Module):
    """transformers' packed-sequence test (diff of integer positions, cumsum of a
    bool), and diff and cumsum with their other arguments."""

    def forward(self, x):
        positions = (x * 10).long()
        steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
        return torch.cat(
            [
                (steps != 1).cumsum(-1).float(),
                torch.diff(x, n=2, dim=1, append=x[:, :2]),
                torch.diff(x > 0.5, dim=1).float(),
                x.cumsum(1),
                (x > 0.5).cumsum(1, dtype=torch.float32),
            ],
            1,
        )


def test_diff_and_cumsum_export_and_equal_torch(tmp_path):
    import onnxruntime

    model = _export(DiffAndCumsum(), FEATURE, tmp_path)
    x = torch.rand(5, 6, generator=torch.Generator().manual_seed(0))
    session = onnxruntime.InferenceSession(model.SerializeToString())
    # Exact but for float sums (x.cumsum) in another order.
    np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], DiffAndCumsum()(x).numpy(), rtol=1e-6, atol=1e-6)


def test_attention_dropout_gets_training_mode_and_mask(tmp_path):
    """torch's sdpa symbolic writes Dropout(weights, ratio); after the export
    every Dropout of GPT-2 trains (training_mode True) and has its mask."""
    from transformers_models import GPT2

    model = _export(GPT2(context=16), [{"name": "x", "dtype": "int64", "shape": [16]}], tmp_path)
    dropouts = [node for node in model.graph.node if node.op_type == "Dropout"]
    attention = [node for node in dropouts if node.name.endswith("attn/Dropout")]
    assert len(dropouts) == 7 and len(attention) == 2, [node.name for node in dropouts]
    assert all(len(node.input) == 3 and len(node.output) == 2 and node.output[1] for node in dropouts)


def test_shape_inference_that_gives_up_leaves_nothing_in_the_working_folder(tmp_path, monkeypatch):
    """ONNX Runtime's symbolic shape inference saves a model it cannot finish into the
    working folder (the user's, where build_artifacts runs) before it raises."""
    from onnx import TensorProto, helper

    from ortflow.models import export_fixes

    nodes = [helper.make_node("Custom", ["x"], ["y"], domain="my.domain"), helper.make_node("Relu", ["y"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="Incomplete symbolic shape inference"):
        export_fixes.symbolic_shape_inference(model)
    export_fixes.infer_shapes(model)  # gives up with a warning
    assert not list(tmp_path.iterdir())


def test_operator_torch_cannot_export_is_named(tmp_path):
    class Cummax(torch.nn.Module):
        def forward(self, x):
            return torch.cummax(x, 1).values

    with pytest.raises(ModelError) as error:
        _export(Cummax(), FEATURE, tmp_path)
    message = str(error.value)
    assert "\n" not in message
    assert re.match(
        r"model.path: torch.onnx cannot export operator aten::cummax of Cummax at ONNX opset 16; "
        r".*torch.onnx.register_custom_op_symbolic.*model.kind: onnx$",
        message,
    ), message


def _pipeline(workdir: Path, config: dict, monkeypatch) -> dict:
    """Train, merge, export and quantize `config`; return its metrics and logs."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    run_snakemake(workdir, config)
    run = config["run"]["name"]
    results, logs = workdir / "results" / run, workdir / "logs" / run
    return {
        "train": json.loads((results / "train/metrics.json").read_text()),
        "quantize": json.loads((results / "export/metrics.json").read_text()),
        "export_log": (logs / "export_model.log").read_text(),
        "quantize_log": (logs / "quantize_model.log").read_text(),
    }


def _export_difference(log: str) -> float:
    difference = re.search(r"logits within ([0-9.e+-]+) of the eval graph's", log)
    assert difference, log
    return float(difference.group(1))


TRAIN = {"world_size": 2, "log_every": 1, "checkpoint_every": 1000, "lr_schedule": {"warmup_steps": 5}}


@pytest.mark.e2e
def test_gpt2_language_model_on_text(tmp_path, monkeypatch):
    """GPT2LMHeadModel (2 layers, 2 heads, width 64, 256 byte tokens) on a slice
    of Python's documentation: the loss falls from log(256), the exported model
    equals the eval graph, and int8 is evaluated and gated."""
    import pydoc_data.topics

    workdir = tmp_path / "work"
    workdir.mkdir()
    topics = pydoc_data.topics.topics
    (workdir / "corpus.txt").write_text("\n\n".join(topics[key] for key in sorted(topics))[:60_000])
    config = {
        "run": {"name": "gpt2"},
        "data": {"source": "text", "text_path": "corpus.txt", "context": 32, "shards": 1},
        "model": {"kind": "torch", "path": "transformers_models:GPT2", "kwargs": {"context": 32}},
        "train": {**TRAIN, "steps": 40, "micro_batch_size": 16, "eval_every": 40, "optimizer": {"lr": 0.003}},
    }
    outcome = _pipeline(workdir, config, monkeypatch)
    losses = [entry["loss"] for entry in outcome["train"]["history"]["train"]]
    assert losses[0] == pytest.approx(np.log(256), abs=0.3) and np.mean(losses[-5:]) < losses[0] - 1.5, losses
    fp32, int8 = outcome["quantize"]["fp32"], outcome["quantize"]["int8"]
    assert fp32["perplexity"] == pytest.approx(outcome["train"]["eval"]["perplexity"], rel=1e-4)
    assert fp32["perplexity"] < 256 / 4, fp32
    assert _export_difference(outcome["export_log"]) <= 1e-4
    gate = outcome["quantize"]["gate"]
    assert gate["metric"] == "perplexity" and gate_judged(gate, outcome["quantize_log"]), (fp32, int8, gate)


def marked_sequences(path: Path, n: int = 800, length: int = 12, vocab: int = 32) -> None:
    """Token ids 2..vocab-1 with padding (id 0, attention mask 0) after a random
    length; class 1 when token 1 occurs in the sequence, which attention must find."""
    rng = np.random.default_rng(0)
    ids = rng.integers(2, vocab, size=(n, length))
    labels = rng.integers(0, 2, n)
    lengths = rng.integers(length // 2, length + 1, n)
    for row in range(n):
        if labels[row]:
            ids[row, rng.integers(0, lengths[row])] = 1
        ids[row, lengths[row]:] = 0
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
    np.savez(path, input_ids=ids.astype(np.int64), attention_mask=mask, y=labels.astype(np.int64))


def small_sources(root: Path) -> dict[str, dict]:
    """The `data` settings of a small text corpus ("text") and of marked_sequences ("marked") in `root`."""
    return {"text": {"source": str(root / "corpus.txt"), "context": 16},
            "marked": {"source": str(root / "marked.npz"), "features": ["input_ids", "attention_mask"]}}


def prepare_small_sources(root: Path) -> Path:
    """Both small_sources written into `root` and prepared into root/<text|marked>/{train,eval}."""
    from ortflow import config as config_mod
    from ortflow.stages.prepare_data import prepare

    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    marked_sequences(root / "marked.npz", n=200)
    for data, source in small_sources(root).items():
        config = config_mod.load(overrides={"run": {"seed": 7}, "data": source, "model": {"kind": "mlp"}})
        prepare(config, root / data / "train", root / data / "eval")
    return root


@pytest.mark.e2e
def test_bert_sequence_classification_on_token_ids(tmp_path, monkeypatch):
    """BertForSequenceClassification (2 layers, width 32) with the attention mask
    as a second input: accuracy well above chance on a balanced task."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    marked_sequences(workdir / "marked.npz")
    config = {
        "run": {"name": "bert"},
        "data": {"source": "marked.npz", "features": ["input_ids", "attention_mask"], "shards": 1},
        "model": {"kind": "torch", "path": "transformers_models:BertClassifier"},
        "train": {**TRAIN, "steps": 60, "micro_batch_size": 16, "eval_every": 60, "optimizer": {"lr": 0.003}},
    }
    outcome = _pipeline(workdir, config, monkeypatch)
    losses = [entry["loss"] for entry in outcome["train"]["history"]["train"]]
    assert losses[-1] < losses[0], losses
    fp32 = outcome["quantize"]["fp32"]
    assert fp32["accuracy"] == pytest.approx(outcome["train"]["eval"]["accuracy"])
    assert fp32["accuracy"] >= 0.8, fp32
    assert _export_difference(outcome["export_log"]) <= 1e-4
    gate = outcome["quantize"]["gate"]
    assert gate["metric"] == "accuracy" and gate_judged(gate, outcome["quantize_log"]), outcome["quantize"]


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_flops_per_sample_count_every_matmul_of_transformers_models(kind, tmp_path):
    """forward_flops against torch's own FLOP counter on the same module: every
    Conv1D (a Gemm on the flattened batch), every attention MatMul (shapes built
    at run time from Shape and Reshape), the LM head, BERT's pooler and classifier."""
    from torch.utils.flop_counter import FlopCounterMode

    from transformers_models import GPT2, BertClassifier

    torch.manual_seed(0)
    module = GPT2(context=16) if kind == "gpt2" else BertClassifier()
    names = ["x"] if kind == "gpt2" else ["input_ids", "attention_mask"]
    features = [{"name": name, "dtype": "int64", "shape": [16]} for name in names]
    counter = FlopCounterMode(display=False)
    with counter:
        module(*[torch.ones(1, 16, dtype=torch.int64) for _ in names])
    # By hand for GPT-2 (width 64, 2 layers, context 16, vocabulary 256): per token and layer the
    # Conv1Ds 2 x 12 x 64^2 and attention 2 x 2 x 16 x 64, then the LM head 2 x 64 x 256.
    by_hand = {"gpt2": 16 * (2 * (24 * 64**2 + 4 * 16 * 64) + 2 * 64 * 256)}
    base = _export(module, features, tmp_path)
    generate.drop_weights(base)  # as build counts them: once the checkpoint holds the weights
    manifest = shard_manifest([(f["name"], f["dtype"], f["shape"]) for f in features])
    assert cost.forward_flops(base, cost.per_sample_values(base, manifest)) == counter.get_total_flops()
    assert counter.get_total_flops() == by_hand.get(kind, counter.get_total_flops())
