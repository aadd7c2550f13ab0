"""The build_artifacts stage: graphs that compute what PyTorch computes, user
models through config alone, rebuilds only on model changes, clear errors."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from conftest import run_snakemake
from ortflow import config as config_mod
from ortflow.data.manifest import read_manifest
from ortflow.graphs.description import Flops, Tensor, read_description
from ortflow.stages.prepare_data import prepare
from ortflow.data.shards import ShardReader
from ortflow.stages import build_artifacts
from ortflow.models import built_in
from ortflow.training import gradients
from ortflow.training.weight_decay import WeightDecay

TESTS = Path(__file__).resolve().parent
OPTIMIZER = {"name": "adamw", "lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
SMALL = {
    "mlp": {"kind": "mlp", "hidden": [16, 8]},
    "cnn": {"kind": "cnn", "width": 32},
    "gpt": {"kind": "gpt", "layers": 2, "heads": 2, "width": 16, "tied": True},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """Train splits of digits, a small text and a float-target regression set."""
    root = tmp_path_factory.mktemp("data")
    text = root / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    rng = np.random.default_rng(0)
    regression = root / "regression.npz"
    np.savez(regression, x=rng.normal(size=(200, 5)).astype(np.float32), y=rng.normal(size=200).astype(np.float32))
    sources = {"digits": {}, "text": {"source": str(text), "context": 8}, "regression": {"source": str(regression)}}
    for name, data in sources.items():
        prepare(config(data=data), root / name / "train", root / name / "eval")
    return {name: root / name / "train" for name in sources}


def config(model: dict | None = None, data: dict | None = None, seed: int = 7) -> config_mod.Config:
    return config_mod.load(overrides={"run": {"seed": seed}, "data": data or {}, "model": model or {},
                                      "train": {"optimizer": OPTIMIZER}})


def build(train_dir: Path, out: Path, model: dict) -> dict:
    # The config's data section only has to pass validation (gpt wants text);
    # the data itself comes from train_dir.
    return build_artifacts.build(config(model, {"source": "text"} if model["kind"] == "gpt" else None), train_dir, out)


def batch_of(train_dir: Path, n: int = 8) -> dict[str, np.ndarray]:
    return ShardReader(train_dir).gather(np.arange(n))


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt"])
def test_graphs_match_pytorch(kind, data, tmp_path):
    """Training-graph gradients equal autograd's, the eval loss equals the
    training loss, and one AdamW step on those gradients equals torch.optim.AdamW's."""
    from onnxruntime.training import api

    train_dir = data["text" if kind == "gpt" else "digits"]
    out = tmp_path / "artifacts"
    description = build(train_dir, out, SMALL[kind])
    manifest = read_manifest(train_dir)
    batch = batch_of(train_dir)
    x, y = batch[description.inputs[0].name], batch[description.label.name]

    state = api.CheckpointState.load_checkpoint(str(out / "checkpoint"))
    module = api.Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
    assert module.input_names() == ["x", "y"]
    module.train()
    loss, logits = module(x, y)

    # The same weights in a fresh torch module (built from another seed, so the
    # comparison does not rest on the seeding being the same).
    torch.manual_seed(999)
    reference = built_in(config(SMALL[kind], {"source": "text"} if kind == "gpt" else None).model, manifest, "cross_entropy")
    parameters = dict(reference.named_parameters())
    assert sorted(parameters) == sorted(description.trainable)
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(torch.from_numpy(state.parameters[name].data))
    torch_logits = reference(torch.from_numpy(x))
    torch_loss = torch.nn.functional.cross_entropy(torch_logits, torch.from_numpy(y))
    torch_loss.backward()

    np.testing.assert_allclose(logits, torch_logits.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(loss), torch_loss.item(), rtol=1e-5)
    for name, parameter in parameters.items():
        grad = parameter.grad.numpy()
        np.testing.assert_allclose(
            state.parameters[name].grad, grad, rtol=1e-4, atol=1e-6 * np.abs(grad).max(), err_msg=name
        )

    if kind == "gpt":  # the loss reads the logits before their Transpose to [batch, vocab, time], flattened
        graph = onnx.load(out / "training_model.onnx").graph
        made_by = {output: node for node in graph.node for output in node.output}
        loss_node = next(node for node in graph.node if node.op_type == "SoftmaxCrossEntropyLoss")
        flatten = made_by[loss_node.input[0]]
        assert flatten.op_type == "Flatten" and made_by[flatten.input[0]].op_type == "MatMul"
        assert f"{description.outputs.logits}_grad" not in made_by  # and no gradient goes through the Transpose

    module.eval()
    eval_loss, eval_logits = module(x, y)
    np.testing.assert_allclose(float(eval_loss), float(loss), rtol=1e-6)
    np.testing.assert_allclose(eval_logits, logits, rtol=1e-6)

    optimizer = api.Optimizer(str(out / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(OPTIMIZER["lr"])
    # The graph has no weight decay; training applies it, here to every parameter (no_decay: []), as one torch group.
    shapes = {name: state.parameters[name].data.shape for name in parameters}
    names = list(parameters)
    WeightDecay(shapes, [], replace(config().train.optimizer, no_decay=())).apply(OPTIMIZER["lr"], names,
                                                                 gradients.parameters(state, names, np))
    optimizer.step()
    # torch steps on ONNX Runtime's gradients (shown equal above): AdamW's first step is about
    # lr x the gradient's sign, which for a gradient of rounding noise alone (the gpt's key biases)
    # the CPU's summation order would decide.
    for name, parameter in parameters.items():
        parameter.grad = torch.from_numpy(state.parameters[name].grad.copy())
    torch_optimizer = torch.optim.AdamW(
        parameters.values(),
        lr=OPTIMIZER["lr"],
        betas=OPTIMIZER["betas"],
        eps=OPTIMIZER["eps"],
        weight_decay=OPTIMIZER["weight_decay"],
    )
    torch_optimizer.step()
    for name, parameter in parameters.items():
        np.testing.assert_allclose(
            state.parameters[name].data, parameter.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name
        )


def test_same_config_same_bytes_and_model_json(data, tmp_path):
    first = build(data["digits"], tmp_path / "a", SMALL["mlp"])
    build(data["digits"], tmp_path / "b", SMALL["mlp"])
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(
        ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint", "inference_base.onnx", "model.json"]
    )
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert not (tmp_path / "a.tmp").exists()
    # 64 -> 16 -> 8 -> 10: multiply-adds counted by hand.
    assert first.flops_per_sample == Flops(2 * (64 * 16 + 16 * 8 + 8 * 10), 4 * (64 * 16 + 16 * 8 + 8 * 10))
    # float32 outputs of the nodes: Flatten and Cast (64, 64), Gemm and ReLU (16, 16, 8, 8), Gemm and Reshape (10, 10).
    assert first.activation_bytes_per_sample == 4 * (64 + 64 + 16 + 16 + 8 + 8 + 10 + 10)
    # An evaluation holds at most Flatten's and Cast's outputs at once (each is freed after the node
    # that reads it), then the logits once more for the loss.
    assert first.eval_bytes_per_sample == 4 * (64 + 64) + 4 * 10
    assert first.parameters == first.trainable_parameters == 64 * 16 + 16 + 16 * 8 + 8 + 8 * 10 + 10
    assert first.inputs == (Tensor("x", "float32", ("batch", 64)),)
    assert first.label == Tensor("y", "int64", ("batch",))
    training = onnx.load(str(tmp_path / "a" / "training_model.onnx"))
    assert [o.name for o in training.graph.output][:2] == [first.outputs.loss, "logits"]
    assert other_seed_differs(data, tmp_path)


def other_seed_differs(data, tmp_path) -> bool:
    other = config(SMALL["mlp"], seed=8)
    build_artifacts.build(other, data["digits"], tmp_path / "c")
    return (tmp_path / "c" / "checkpoint").read_bytes() != (tmp_path / "a" / "checkpoint").read_bytes()


def onnx_model(path: Path, input_name: str = "x", op: str | None = None, ir_version: int = 8, opset: int = 16) -> Path:
    """A 64 -> 10 linear model as an ONNX file, optionally with `op` after the MatMul."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", [input_name, "weight"], ["scores" if op else "out"], name="matmul")]
    if op:
        nodes.append(helper.make_node(op, ["scores"], ["out"], name=f"my_{op.lower()}"))
    graph = helper.make_graph(
        nodes,
        "user",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 10])],
        [
            numpy_helper.from_array(rng.normal(0, 0.1, (64, 10)).astype(np.float32), "weight"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    onnx.save(model, str(path))
    return path


@pytest.mark.e2e
def test_user_onnx_model_through_the_rule(tmp_path):
    """model.kind onnx via config alone; then train.* changes leave the
    artifacts alone and a model.* change rebuilds them."""
    workdir = tmp_path / "work"
    path = onnx_model(tmp_path / "user.onnx")
    settings = {"model": {"kind": "onnx", "path": str(path), "loss": "auto"}, "train": {"steps": 10}}
    run_snakemake(workdir, settings, "build_artifacts")
    description = read_description(workdir / "results/digits/artifacts/model.json")
    assert description.kind == "onnx"
    assert description.outputs.logits == "out"
    assert list(description.trainable) == ["weight"] and description.parameters == 640
    assert description.flops_per_sample.forward == 2 * 640

    train_only = {**settings, "train": {"steps": 99, "micro_batch_size": 7,
                                        "optimizer": {"lr": 0.5, "weight_decay": 0.5, "no_decay": ["bias"]}}}
    dry = run_snakemake(workdir, train_only, "build_artifacts", "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr
    optimizer_change = {**settings, "train": {"optimizer": {"eps": 1e-6}}}
    dry = run_snakemake(workdir, optimizer_change, "build_artifacts", "-n")
    assert "build_artifacts" in dry.stdout
    model_change = {**settings, "model": {**settings["model"], "loss": "cross_entropy"}}
    dry = run_snakemake(workdir, model_change, "build_artifacts", "-n")
    assert "build_artifacts" in dry.stdout and "params" in dry.stdout

    # The ONNX file is an input: replaced in place (same path, another graph), the artifacts are rebuilt from it.
    onnx_model(path, op="Relu")
    run_snakemake(workdir, settings, "build_artifacts")
    rebuilt = onnx.load(str(workdir / "results/digits/artifacts/inference_base.onnx"))
    assert "Relu" in {node.op_type for node in rebuilt.graph.node}


@pytest.mark.e2e
def test_user_torch_module_through_the_rule(tmp_path, monkeypatch):
    modules = tmp_path / "modules"
    modules.mkdir()
    module = modules / "artifacts_user_model.py"
    shutil.copy(TESTS / module.name, module)
    monkeypatch.setenv("PYTHONPATH", str(modules), prepend=os.pathsep)
    workdir = tmp_path / "work"
    settings = {
        "model": {"kind": "torch", "path": "artifacts_user_model:TinyNet", "kwargs": {"hidden": 5}, "frozen": ["body.bias"]}
    }
    run_snakemake(workdir, settings, "build_artifacts")
    description = read_description(workdir / "results/digits/artifacts/model.json")
    assert list(description.trainable) == ["body.weight", "head.weight", "head.bias"]
    assert list(description.frozen) == ["body.bias"]
    assert description.parameters == 64 * 5 + 5 + 5 * 10 + 10
    assert description.trainable_parameters == description.parameters - 5

    # The module's file is an input, found without importing it: an edit rebuilds the artifacts.
    module.write_text(module.read_text() + "\n# edited\n")
    dry = run_snakemake(workdir, settings, "build_artifacts", "-n")
    assert f"Updated input files: {module}" in dry.stdout, dry.stdout


def test_ir_version_above_10_is_lowered_when_lossless(data, tmp_path, caplog):
    path = onnx_model(tmp_path / "ir11.onnx", ir_version=11)
    with caplog.at_level(logging.WARNING):
        description = build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path)})
    assert list(description.trainable) == ["weight"]
    assert "IR version 11 lowered to 10" in caplog.text
    assert onnx.load(str(tmp_path / "out" / "inference_base.onnx")).ir_version == 10


def test_ir_version_above_10_that_needs_it_is_explained(data, tmp_path):
    path = onnx_model(tmp_path / "opset23.onnx", ir_version=11, opset=23)
    with pytest.raises(ValueError, match=r"IR version 11 and uses ONNX opset 23.*re-export"):
        build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path)})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["frozen", "trainable"])
def test_pattern_that_matches_no_parameter(data, tmp_path, key):
    path = onnx_model(tmp_path / "user.onnx")
    with pytest.raises(ValueError, match=rf"^model.{key}: 'bias' matches none of the model's parameters: weight \(1 in "
                                         r"all; patterns as train.optimizer.no_decay's\)$"):
        build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path), key: ["weight", "bias"]})


def test_inputs_that_are_not_the_features(data, tmp_path):
    path = onnx_model(tmp_path / "user.onnx", input_name="pixels")
    with pytest.raises(ValueError, match=r"model inputs \['pixels'\] do not match the data's feature names \['x'\]"):
        build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path)})


def test_operator_without_gradient_is_named(data, tmp_path):
    path = onnx_model(tmp_path / "user.onnx", op="Round")
    with pytest.raises(ValueError, match=r"no gradient for operator Round \(node my_round\)"):
        build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path)})


def test_loss_that_does_not_fit_the_data(data, tmp_path):
    with pytest.raises(ValueError, match=r"'cross_entropy' needs integer class labels but the data's label 'y' is float32"):
        build(data["regression"], tmp_path / "out", {"kind": "mlp", "loss": "cross_entropy"})
    with pytest.raises(ValueError, match=r"'mse' compares outputs with float targets but the data's label 'y' is int64"):
        build(data["digits"], tmp_path / "out", {"kind": "mlp", "loss": "mse"})
    # Regression with the default loss builds and takes a step.
    description = build(data["regression"], tmp_path / "out", {"kind": "mlp", "hidden": [4]})
    assert description.loss == "mse" and description.label.shape == ("batch",)


def test_torch_path_must_name_a_module_class_and_nothing_is_called(data, tmp_path, monkeypatch):
    """`os:system` with kwargs {command: ...} would run a shell command if it were called."""
    marker = tmp_path / "marker"
    monkeypatch.chdir(tmp_path)
    model = {"kind": "torch", "path": "os:system", "kwargs": {"command": f"id > {marker}"}}
    with pytest.raises(ValueError, match=r"model.path: os:system is a builtin_function_or_method, not a subclass "
                                         r"of torch.nn.Module"):
        build(data["digits"], tmp_path / "out", model)
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"model.path: json:JSONDecoder is the class JSONDecoder, not a subclass"):
        build(data["digits"], tmp_path / "out", {"kind": "torch", "path": "json:JSONDecoder"})
    with pytest.raises(ValueError, match=r"'\.\./x:Y' is not an import path"):
        build(data["digits"], tmp_path / "out", {"kind": "torch", "path": "../x:Y"})


def test_working_directory_is_importable_but_comes_last(data, tmp_path, monkeypatch):
    """A module next to the config is found; a file there named like an installed
    module (here `tabulate.py`) does not replace it."""
    import sys
    import sysconfig

    (tmp_path / "my_net.py").write_text((TESTS / "artifacts_user_model.py").read_text())
    (tmp_path / "tabulate.py").write_text("raise SystemExit('the working directory shadowed tabulate')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop("tabulate", None)
    description = build(data["digits"], tmp_path / "out", {"kind": "torch", "path": "my_net:TinyNet"})
    assert list(description.trainable) == ["body.weight", "body.bias", "head.weight", "head.bias"]
    assert sys.path.index(str(tmp_path)) > sys.path.index(sysconfig.get_paths()["purelib"])
    import tabulate

    assert Path(tabulate.__file__).parent != tmp_path


def external_data_model(folder: Path, location: str) -> tuple[Path, np.ndarray]:
    """The 64 -> 10 linear model with its weight stored as external data in `location`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = onnx_model(folder / "model.onnx")
    model = onnx.load(str(path))
    weight = numpy_helper.to_array(model.graph.initializer[0])
    onnx.external_data_helper.set_external_data(model.graph.initializer[0], location=location)
    model.graph.initializer[0].ClearField("raw_data")
    model.graph.initializer[0].data_location = TensorProto.EXTERNAL
    onnx.save(model, str(path))
    return path, weight


def test_external_data_in_the_model_folder_is_read(data, tmp_path):
    path, weight = external_data_model(tmp_path / "model", "weight.bin")
    (tmp_path / "model" / "weight.bin").write_bytes(weight.tobytes())
    build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path)})
    base = onnx.load(str(tmp_path / "out" / "inference_base.onnx"))
    assert np.array_equal(numpy_helper.to_array(base.graph.initializer[0]), weight)


@pytest.mark.parametrize("target", ["outside", "fifo"])
def test_external_data_outside_the_model_folder_is_refused(data, tmp_path, target):
    """A symlink in the model's folder to a file elsewhere (onnx itself follows it),
    or a FIFO: refused at build_artifacts, naming the initializer and the location;
    nothing of the file reaches any output."""
    import os

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"SECRET-PASSWORD!" * 160)  # 2560 bytes, the weight's size
    path, _ = external_data_model(tmp_path / "model", "weight.bin")
    link = tmp_path / "model" / "weight.bin"
    if target == "outside":
        link.symlink_to(secret)
        reason = f"which is a file outside the model's folder ({secret})"
    else:
        os.mkfifo(link)  # reading it would block forever
        reason = f"which is not a regular file ({link})"
    with pytest.raises(ValueError) as error:
        build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path)})
    assert f"model.path: {path}: initializer 'weight' has its data in 'weight.bin', {reason}" in str(error.value)
    assert not (tmp_path / "out").exists()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and p != secret]
    assert [p for p in written if b"SECRET-PASSWORD" in p.read_bytes()] == []


def test_bce_with_logits_is_torchs_on_logits_of_100(tmp_path):
    """Unscaled features give logits of +-100: ORT's own BCEWithLogitsLoss takes
    log(1 - sigmoid(100)) = log(0) there; ortflow's equals torch's, loss and gradient."""
    from onnxruntime.training import api

    x = np.zeros((8, 3), np.float32)
    x[:, 0] = [1000, -1000, 1000, -1000, 1000, -1000, 20, -3]
    y = np.array([1, 0, 0, 1, 1, 0, 1, 1], np.int64)  # right, right, wrong, wrong, ...
    np.savez(tmp_path / "unscaled.npz", x=x, y=y)
    prepare(config(data={"source": str(tmp_path / "unscaled.npz"), "eval_fraction": 0.5, "shards": 1}),
            tmp_path / "train", tmp_path / "eval")
    weight = np.array([[0.1], [0.0], [0.0]], np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["column"]),
                               helper.make_node("Reshape", ["column", "flat"], ["out"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n"])],
                              [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(np.array([-1]), "flat")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "linear.onnx"))
    out = tmp_path / "out"
    build(tmp_path / "train", out, {"kind": "onnx", "path": str(tmp_path / "linear.onnx"), "loss": "bce_with_logits"})

    state = api.CheckpointState.load_checkpoint(str(out / "checkpoint"))
    module = api.Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
    module.train()
    loss, logits = module(x, y)
    assert sorted(np.abs(logits).tolist())[-6:] == [100.0] * 6
    w = torch.tensor(weight, requires_grad=True)
    torch_loss = torch.nn.BCEWithLogitsLoss()((torch.from_numpy(x) @ w)[:, 0], torch.from_numpy(y).float())
    torch_loss.backward()
    assert np.isfinite(float(loss)) and float(loss) == pytest.approx(torch_loss.item(), rel=1e-6)
    assert torch_loss.item() > 24  # two of eight records are wrong by 100
    np.testing.assert_allclose(state.parameters["weight"].grad, w.grad.numpy(), rtol=1e-5)


def test_embedding_takes_int64_ids_from_the_shards(tmp_path, monkeypatch):
    """Token ids stored as int64 in an .npz reach a user's nn.Embedding as int64: the
    graph's input is int64 and ORT's loss and embedding gradient equal torch's."""
    from onnxruntime.training import api

    from artifacts_user_model import TokenBag

    monkeypatch.syspath_prepend(str(TESTS))
    rng = np.random.default_rng(4)
    np.savez(tmp_path / "ids.npz", ids=rng.integers(0, 100, size=(40, 5)), y=rng.integers(0, 2, 40))
    prepare(config(data={"source": str(tmp_path / "ids.npz"), "features": ["ids"]}), tmp_path / "train", tmp_path / "eval")
    out = tmp_path / "out"
    description = build(tmp_path / "train", out, {"kind": "torch", "path": "artifacts_user_model:TokenBag"})
    assert description.inputs == (Tensor("ids", "int64", ("batch", 5)),)
    assert "Cast" not in {n.op_type for n in onnx.load(str(out / "inference_base.onnx")).graph.node}

    batch = batch_of(tmp_path / "train")
    state = api.CheckpointState.load_checkpoint(str(out / "checkpoint"))
    module = api.Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
    module.train()
    loss, _ = module(batch["ids"], batch["y"])
    reference = TokenBag()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            parameter.copy_(torch.from_numpy(state.parameters[name].data))
    torch_loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(batch["ids"])), torch.from_numpy(batch["y"]))
    torch_loss.backward()
    assert float(loss) == pytest.approx(torch_loss.item(), rel=1e-5)
    np.testing.assert_allclose(state.parameters["embed.weight"].grad, reference.embed.weight.grad.numpy(), atol=1e-6)


def test_old_opset_that_cannot_be_converted_is_explained(data, tmp_path):
    path = onnx_model(tmp_path / "opset9.onnx", op="NoSuchOp", ir_version=4, opset=9)
    with pytest.raises(ValueError, match=r"opset9.onnx is at ONNX opset 9, below 12 .* cannot convert it to opset 16 "
                                         r"\(node .my_nosuchop. has operator NoSuchOp, not an ONNX operator\); re-export"):
        build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(path)})


def fixed_batch_model(path: Path, mixing: bool) -> Path:
    """A model zoo's shape: a fixed batch of 1, a residual `Sum` (no gradient in
    ONNX Runtime), an initializer no node reads, and a Reshape to [1, 10] before
    the output. `mixing`: the scores minus their mean over the batch, which makes
    each record's output depend on the others."""
    random = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(random.normal(size=(64, 10)).astype(np.float32), "weight"),
                    numpy_helper.from_array(random.normal(size=10).astype(np.float32), "bias"),
                    numpy_helper.from_array(np.array([1, 10], np.int64), "one_row"),
                    numpy_helper.from_array(np.zeros(3, np.float32), "unused")]
    nodes = [helper.make_node("MatMul", ["x", "weight"], ["scores"]),
             helper.make_node("Sum", ["scores", "bias", "scores"], ["summed"])]
    if mixing:
        nodes += [helper.make_node("ReduceMean", ["summed"], ["mean"], axes=[0], keepdims=1),
                  helper.make_node("Sub", ["summed", "mean"], ["centred"])]
    nodes.append(helper.make_node("Reshape", ["centred" if mixing else "summed", "one_row"], ["out"]))
    graph = helper.make_graph(nodes, "fixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 10])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_fixed_batch_model_is_adapted_and_trains(data, tmp_path):
    """The Reshape to [1, 10] reshapes to [-1, 10], the Sum becomes Adds, the
    unread initializer goes, and the model trains on batches of any size."""
    import onnxruntime as ort
    from onnxruntime.training import api

    original = onnx.load(str(fixed_batch_model(tmp_path / "fixed.onnx", mixing=False)))
    description = build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(tmp_path / "fixed.onnx")})
    assert sorted(description.trainable) == ["bias", "weight"]
    base = onnx.load(str(tmp_path / "out" / "inference_base.onnx"))
    assert [n.op_type for n in base.graph.node] == ["MatMul", "Add", "Add", "Reshape"]
    initializers = {t.name: numpy_helper.to_array(t) for t in base.graph.initializer}
    assert "unused" not in initializers and initializers["one_row"].tolist() == [-1, 10]
    # Record by record, the adapted model computes what the file computes.
    batch = batch_of(data["digits"])
    file_session = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    adapted = ort.InferenceSession(base.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": batch["x"]})[0]
    for row in range(len(batch["x"])):
        np.testing.assert_allclose(adapted[row], file_session.run(None, {"x": batch["x"][row:row + 1]})[0][0], rtol=1e-6)
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "out" / "checkpoint"))
    module = api.Module(str(tmp_path / "out" / "training_model.onnx"), state, str(tmp_path / "out" / "eval_model.onnx"))
    module.train()
    loss, _ = module(batch["x"], batch["y"])
    assert np.isfinite(loss) and np.abs(state.parameters["bias"].grad).max() > 0


def test_fixed_batch_the_graph_depends_on_is_explained(data, tmp_path):
    """A model fixed at batch 1 that mixes the records of a batch cannot be made dynamic."""
    fixed_batch_model(tmp_path / "fixed.onnx", mixing=True)
    with pytest.raises(ValueError, match=r"fixed.onnx has a fixed batch dimension \('x' \[1, 64\], 'out' \[1, 10\]\) "
                                         r"that its graph depends on: on a batch of 2 records its outputs for one record "
                                         r"depend on the other; re-export the model with a dynamic batch axis"):
        build(data["digits"], tmp_path / "out", {"kind": "onnx", "path": str(tmp_path / "fixed.onnx")})
