"""Models as users bring them, through the real workflow: an ONNX file from the
model zoo exactly as shipped (the small SqueezeNet in the onnx package's own test
data: opset 9, IR version 3, initializers listed as inputs, a fixed batch of 1),
and the light ResNet-50 beside it, which ONNX Runtime cannot differentiate; and
(fast, without the workflow) external data that does not fit its file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.training.api import CheckpointState

from conftest import run_snakemake, shard_manifest
from ortflow import cli
from ortflow.data.shards import ShardReader
from ortflow.errors import ModelError
from ortflow.graphs.description import read_description
from ortflow.models import user

pytestmark = pytest.mark.e2e

SQUEEZENET = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_squeezenet.onnx"


def test_model_zoo_squeezenet_trains_as_shipped(workdir):
    shipped = onnx.load(str(SQUEEZENET))
    assert (shipped.ir_version, shipped.opset_import[0].version, len(shipped.graph.input)) == (3, 9, 53)
    image = next(i for i in shipped.graph.input if i.name == "data_0")
    assert [d.dim_value for d in image.type.tensor_type.shape.dim] == [1, 3, 224, 224]
    # Random images of its input shape, labels of two classes.
    rng = np.random.default_rng(0)
    workdir.mkdir(parents=True)
    labels = np.zeros((16, 1, 1), np.int64)
    labels[:2] = 1
    np.savez(workdir / "images.npz", data_0=rng.random((16, 3, 224, 224), dtype=np.float32), y=labels)
    config = {
        "run": {"name": "zoo"},
        "data": {"source": "images.npz", "features": ["data_0"], "eval_fraction": 0.25, "shards": 1},
        "model": {"kind": "onnx", "path": str(SQUEEZENET)},
        "train": {"steps": 8, "micro_batch_size": 2, "log_every": 1, "eval_every": 8, "checkpoint_every": 8,
                  "optimizer": {"lr": 0.05}, "lr_schedule": {"name": "constant", "warmup_steps": 0}},
    }
    run_snakemake(workdir, config, "export_model")
    build_log = (workdir / "logs/zoo/build_artifacts.log").read_text()
    assert "ONNX opset 9 converted to 16 by onnx's version converter" in build_log
    assert "52 initializers listed as graph inputs (IR version < 4 style) are initializers only" in build_log
    assert "fixed batch dimension of 'data_0' [1, 3, 224, 224], 'softmaxout_1' [1, 1000, 1, 1] made dynamic" in build_log
    assert "the model's output 'softmaxout_1' comes from Softmax node 'n65', so it is probabilities" in build_log
    # Its convolution weights are ConstantOfShape nodes (all 0.02), so its 1000 class
    # scores stay equal and the loss log(1000) whatever it learns; its biases train.
    history = json.loads((workdir / "results/zoo/train/metrics.json").read_text())["history"]["train"]
    assert [entry["step"] for entry in history] == list(range(1, 9))
    assert all(abs(entry["loss"] - np.log(1000)) < 1e-4 for entry in history), history
    trainable = json.loads((workdir / "results/zoo/artifacts/model.json").read_text())["trainable"]
    assert len(trainable) == 13 and all(name.endswith("_b_0") for name in trainable)
    first = CheckpointState.load_checkpoint(str(workdir / "results/zoo/artifacts/checkpoint")).parameters
    last = CheckpointState.load_checkpoint(str(workdir / "results/zoo/checkpoint/checkpoint")).parameters
    moved = [float(np.abs(last[name].data - first[name].data).max()) for name in trainable]
    assert max(moved) > 0.1 and max(moved) <= 8 * 0.05 + 1e-3, moved  # AdamW moves at most lr per step
    exported = onnx.load(str(workdir / "results/zoo/export/model.onnx"))
    assert exported.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_model_zoo_resnet50_is_adapted_then_stops_in_ort_backward(tmp_path, monkeypatch, capsys, caplog):
    """The light ResNet-50 of onnx's test data (Caffe2's: opset 9, BatchNorms in
    inference mode, residual Sums, a data-queue initializer no node reads, a
    Reshape to [1, 2048]) gets through every adaptation; then ONNX Runtime
    1.19.2's backward pass fails on it, and the stage says so in one line naming
    the node, instead of blaming the loss."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", **{"gpu_0/data_0": rng.random((8, 3, 224, 224), dtype=np.float32),
                                          "y": np.arange(8) % 2})
    with caplog.at_level("INFO"):  # the adaptations are logged (the stage's log), the error printed
        code, stderr = build_artifacts_cli(tmp_path, {
            "data": {"source": "images.npz", "features": ["gpu_0/data_0"], "shards": 1},
            "model": {"kind": "onnx", "path": str(SQUEEZENET.with_name("light_resnet50.onnx"))},
        }, monkeypatch, capsys)
    assert code == 1 and not (tmp_path / "artifacts").exists()
    for change in ("1 initializer(s) that no node reads removed: ['gpu_0/imagenet1k_blobs_queue_",
                   "16 Sum node(s) written as Add", "Reshape node(s) ['n173'] to a fixed batch of 1 now reshape",
                   "7 BatchNormalization nodes switched to training mode"):
        assert change in caplog.text, change
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("ortflow build-artifacts: error: ONNX Runtime's backward pass fails at its node "
                            "'AccumulateGrad_r161_grad' (Sum) on a batch of 2 records: "), error
    assert error.endswith("freeze the parameters before that node (model.frozen) or replace the operator it "
                          "differentiates"), error


def model_with_external_weight(folder: Path, data: bytes, **place: int) -> Path:
    """A 4 -> 4 MatMul whose weight lives in `folder`/weight.bin (holding `data`), at `place` (offset, length)."""
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.eye(4, dtype=np.float32), "weight")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["logits"])], "external",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.external_data_helper.set_external_data(model.graph.initializer[0], location="weight.bin", **place)
    model.graph.initializer[0].ClearField("raw_data")
    model.graph.initializer[0].data_location = TensorProto.EXTERNAL
    (folder / "weight.bin").write_bytes(data)
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


@pytest.mark.parametrize("offset, length, read", [(0, 1 << 40, "1099511627776 bytes from offset 0"),
                                                  (60, 8, "8 bytes from offset 60"),
                                                  (100, 0, "the rest of the file from offset 100")])
def test_external_data_beyond_its_file_is_refused_in_one_line(tmp_path, offset, length, read):
    """onnx would read `length` bytes at once: 2^40 of them is a MemoryError (a traceback), not an error."""
    path = model_with_external_weight(tmp_path / "model", np.eye(4, dtype=np.float32).tobytes(),
                                      offset=offset, length=length)
    with pytest.raises(ModelError) as error:
        user.load_onnx(str(path))
    assert str(error.value) == (
        f"model.path: {path}: initializer 'weight' has its data in 'weight.bin': {read}, beyond the end of the file "
        "(64 bytes): the model does not match its data file; save the two again together (onnx.save_model with "
        "save_as_external_data=True)")
    # Where it fits, it is read.
    fits = model_with_external_weight(tmp_path / "fits", bytes(8) + np.eye(4, dtype=np.float32).tobytes(),
                                      offset=8, length=64)
    assert np.array_equal(onnx.numpy_helper.to_array(user.load_onnx(str(fits)).graph.initializer[0]), np.eye(4))


def test_external_data_at_a_malformed_offset_is_refused(tmp_path):
    path = model_with_external_weight(tmp_path / "model", bytes(64))
    model = onnx.load(str(path), load_external_data=False)
    model.graph.initializer[0].external_data.add(key="offset", value="-8")  # the last entry counts, as in onnx
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match=r"initializer 'weight' has its data in 'weight.bin' at offset '-8', "
                                         r"length '0'; both must be whole numbers of bytes"):
        user.load_onnx(str(path))


def test_external_data_is_checked_where_onnx_reads_it(tmp_path):
    """Of two `location` entries onnx reads the last: that is the one checked (here a link out of the folder)."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"SECRET-PASSWORD!" * 4)
    path = model_with_external_weight(tmp_path / "model", bytes(64))
    (path.parent / "link.bin").symlink_to(secret)
    model = onnx.load(str(path), load_external_data=False)
    model.graph.initializer[0].external_data.add(key="location", value="link.bin")
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match=rf"initializer 'weight' has its data in 'link.bin', which is a file outside "
                                         rf"the model's folder \({secret}\)"):
        user.load_onnx(str(path))


def test_model_zoo_squeezenet_converted_to_opset_16_keeps_ir_3_and_trains_on_a_flat_label(workdir):
    """The same SqueezeNet converted by the user with onnx's version converter, which keeps IR version 3
    (ONNX's checker then refused it: `conv10_b_0__SHAPE in initializer but not in graph input`), trained on
    a flat label against its [N, 1000, 1, 1] Softmax output (ONNX Runtime's loss failed on the shapes):
    the IR version is raised, the loss reads the Softmax's input, and the exported and int8 models return
    the Softmax's probabilities in the model's own shape."""
    import onnxruntime as ort
    from onnx import version_converter

    converted = version_converter.convert_version(onnx.load(str(SQUEEZENET)), 16)
    assert (converted.ir_version, converted.opset_import[0].version) == (3, 16)
    workdir.mkdir(parents=True)
    onnx.save(converted, str(workdir / "squeezenet16.onnx"))
    rng = np.random.default_rng(0)
    np.savez(workdir / "images.npz", data_0=rng.random((16, 3, 224, 224), dtype=np.float32), y=np.arange(16) % 2)
    config = {
        "run": {"name": "zoo16"},
        "data": {"source": "images.npz", "features": ["data_0"], "eval_fraction": 0.25, "shards": 1},
        "model": {"kind": "onnx", "path": "squeezenet16.onnx"},
        "train": {"steps": 2, "micro_batch_size": 2, "log_every": 1, "eval_every": 2, "checkpoint_every": 2},
        "export": {"calibration_batches": 1},
    }
    run_snakemake(workdir, config)
    build_log = (workdir / "logs/zoo16/build_artifacts.log").read_text()
    assert "squeezenet16.onnx: IR version 3 raised to 8 (what ONNX opset 16 needs)" in build_log
    description = read_description(workdir / "results/zoo16/artifacts/model.json")
    logits = description.outputs.logits
    assert description.outputs.inference == "softmaxout_1" and logits != "softmaxout_1"
    assert (f"the model's output 'softmaxout_1' comes from Softmax node 'n65', so it is probabilities: model.loss "
            f"cross_entropy is computed on the Softmax's input '{logits}' (its logits), and the exported model "
            "keeps the Softmax") in build_log
    training = onnx.load(str(workdir / "results/zoo16/artifacts/training_model.onnx"))
    loss_node = next(node for node in training.graph.node if node.op_type == "SoftmaxCrossEntropyLoss")
    assert loss_node.input[0] == logits
    metrics = json.loads((workdir / "results/zoo16/train/metrics.json").read_text())
    assert metrics["eval"]["accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 eval records
    quantized = json.loads((workdir / "results/zoo16/export/metrics.json").read_text())
    assert quantized["quantize"] == "static" and quantized["int8"]["loss"] == pytest.approx(np.log(1000), abs=1e-3)
    images = rng.random((3, 3, 224, 224), dtype=np.float32)
    for name in ("model.onnx", "model.int8.onnx"):
        path = workdir / "results/zoo16/export" / name
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert [o.name for o in session.get_outputs()] == ["softmaxout_1"]
        probabilities = session.run(None, {"data_0": images})[0]
        assert probabilities.shape == (3, 1000, 1, 1)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


def write_softmax_mlp(path: Path, classes: int = 10) -> None:
    """64 -> 32 -> classes, then Unsqueeze to [N, classes, 1, 1] and Softmax over axis 1:
    a classifier that returns probabilities in the layout of a pooled CNN's."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array((rng.standard_normal((64, 32)) * 0.18).astype(np.float32), "w0"),
                    numpy_helper.from_array(np.zeros(32, np.float32), "b0"),
                    numpy_helper.from_array((rng.standard_normal((32, classes)) * 0.25).astype(np.float32), "w1"),
                    numpy_helper.from_array(np.zeros(classes, np.float32), "b1"),
                    numpy_helper.from_array(np.array([2, 3], np.int64), "pool_axes")]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["mm0"]), helper.make_node("Add", ["mm0", "b0"], ["pre0"]),
             helper.make_node("Relu", ["pre0"], ["h0"]), helper.make_node("MatMul", ["h0", "w1"], ["mm1"]),
             helper.make_node("Add", ["mm1", "b1"], ["scores"]),
             helper.make_node("Unsqueeze", ["scores", "pool_axes"], ["pooled"]),
             helper.make_node("Softmax", ["pooled"], ["probabilities"], axis=1, name="softmax")]
    graph = helper.make_graph(nodes, "softmax_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["n", classes, 1, 1])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_a_final_softmax_is_trained_through_its_input_and_kept_in_the_export(workdir):
    """Digits through a classifier that ends in Softmax, with [N, 10, 1, 1] outputs against the flat label:
    cross-entropy on its input (squeezed to [N, 10]) learns (on the probabilities it would be stuck above
    log(10) - 1 + ...), and the eval loss is the cross-entropy of the exported model's probabilities."""
    import onnxruntime as ort

    workdir.mkdir(parents=True)
    write_softmax_mlp(workdir / "softmax_mlp.onnx")
    config = {"run": {"name": "softmax"}, "data": {"standardize": True},
              "model": {"kind": "onnx", "path": "softmax_mlp.onnx"},
              "train": {"steps": 100, "eval_every": 100, "checkpoint_every": 100, "optimizer": {"lr": 0.01}},
              "export": {"max_accuracy_drop": 5}}
    result = run_snakemake(workdir, config)
    assert ("  output    'probabilities' follows the logits 'pooled' (a final Softmax or LogSoftmax, kept in the "
            "exported model); the loss is computed on the logits") in result.stdout
    build_log = (workdir / "logs/softmax/build_artifacts.log").read_text()
    assert ("the model's output 'probabilities' comes from Softmax node 'softmax', so it is probabilities: "
            "model.loss cross_entropy is computed on the Softmax's input 'pooled' (its logits)") in build_log
    assert ("the model's logits 'pooled' are [batch, 10, 1, 1] and the data's label 'y' is [batch]: the logits "
            "are reshaped to [batch, 10] for model.loss cross_entropy") in build_log
    results = workdir / "results/softmax"
    evaluation = json.loads((results / "train/metrics.json").read_text())["eval"]
    assert evaluation["loss"] < 0.5 and evaluation["accuracy"] > 0.85, evaluation
    reader = ShardReader(results / "data/eval")
    batch = ShardReader(results / "data/eval", raw=True).gather(np.arange(len(reader)))  # the export standardizes
    session = ort.InferenceSession(str(results / "export/model.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["probabilities"]
    probabilities = session.run(None, {"x": batch["x"]})[0]
    assert probabilities.shape == (len(reader), 10, 1, 1)
    picked = probabilities[np.arange(len(reader)), batch["y"], 0, 0].astype(np.float64)
    assert -np.log(picked).mean() == pytest.approx(evaluation["loss"], rel=1e-4)
    assert (probabilities[:, :, 0, 0].argmax(axis=1) == batch["y"]).mean() == pytest.approx(evaluation["accuracy"])
    quantized = json.loads((results / "export/metrics.json").read_text())
    assert quantized["fp32"]["loss"] == pytest.approx(evaluation["loss"], rel=1e-4) and quantized["warnings"] == []


def build_artifacts_cli(folder: Path, config: dict, monkeypatch, capsys) -> tuple[int, str]:
    """`ortflow prepare-data`, then `ortflow build-artifacts`, as a user runs them in `folder`, here in
    this process (cli.main, which the console script calls; no Python started twice): the second's exit
    code and what it wrote to stderr."""
    import yaml

    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(folder)
    assert cli.main(["prepare-data", "--train", "data/train", "--eval", "data/eval", "--config", "config.yaml"]) == 0
    capsys.readouterr()
    code = cli.main(["build-artifacts", "--train", "data/train", "--out", "artifacts", "--config", "config.yaml"])
    return code, capsys.readouterr().err


def iris_csv(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd
    from sklearn.datasets import load_iris

    x, y = load_iris(return_X_y=True)
    frame = pd.DataFrame(x, columns=["f0", "f1", "f2", "f3"]).assign(target=y)
    frame.to_csv(folder / "iris.csv", index=False)
    return x.astype(np.float32), y


def test_a_scikit_learn_model_converted_to_onnx_is_refused_naming_its_operators(tmp_path, monkeypatch, capsys):
    """skl2onnx's LogisticRegression: ai.onnx.ml operators, no gradients, nothing trainable. It was sent to
    onnx's version converter, and the message asked to re-export it at opset 16, which cannot help."""
    from sklearn.linear_model import LogisticRegression
    from skl2onnx import to_onnx

    x, y = iris_csv(tmp_path)
    onnx.save(to_onnx(LogisticRegression(max_iter=500).fit(x, y), x[:1]), str(tmp_path / "logreg.onnx"))
    code, stderr = build_artifacts_cli(tmp_path, {
        "data": {"source": "iris.csv", "features": ["f0", "f1", "f2", "f3"], "label": "target", "shards": 1},
        "model": {"kind": "onnx", "path": "logreg.onnx"}}, monkeypatch, capsys)
    assert code == 1 and not (tmp_path / "artifacts").exists()
    assert stderr.strip().splitlines()[-1] == (
        "ortflow build-artifacts: error: model.path: logreg.onnx has operators of the ai.onnx.ml domain "
        "(LinearClassifier, Normalizer, ZipMap), as scikit-learn models converted to ONNX have; ONNX Runtime has no "
        "gradients for them, so ortflow cannot train it (it trains networks of standard ONNX operators whose "
        "weights are float initializers): fit it in scikit-learn, or train a network instead (model.kind: mlp, or "
        "your own with model.kind: torch)")


def test_a_model_without_float_initializers_is_refused_saying_so(tmp_path, monkeypatch, capsys):
    """Weights in a Constant node, none as initializers: nothing that ONNX Runtime could train."""
    from onnx import TensorProto, helper, numpy_helper

    iris_csv(tmp_path)
    weight = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["w"], value=weight), helper.make_node("MatMul", ["x", "w"], ["out"])],
        "constant_weights", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "constant.onnx"))
    code, stderr = build_artifacts_cli(tmp_path, {
        "data": {"source": "iris.csv", "features": ["f0", "f1", "f2", "f3"], "label": "target", "shards": 1},
        "model": {"kind": "onnx", "path": "constant.onnx"}}, monkeypatch, capsys)
    assert code == 1 and not (tmp_path / "artifacts").exists()
    assert stderr.strip().splitlines()[-1] == (
        "ortflow build-artifacts: error: model.path: constant.onnx has no float initializer, so nothing to train "
        "(its weights, if any, are held in Constant nodes or node attributes); export the model with its weights as "
        "initializers (torch.onnx.export(..., do_constant_folding=False) keeps parameters as initializers), or use "
        "model.kind: torch")


def linear_model(path: Path, outputs: int, shape: list) -> np.ndarray:
    """x [n, 3] -> MatMul [3, outputs] -> Reshape to [n, *shape]: a model whose output shape is chosen."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(1).normal(size=(3, outputs)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["flat"]), helper.make_node("Reshape", ["flat", "shape"], ["out"])],
        "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", *shape])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array([-1, *shape], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return weight


def build_on(tmp_path: Path, y: np.ndarray, model: dict) -> dict:
    """prepare_data and build_artifacts of x [24, 3] and the label `y`, in-process."""
    from ortflow import config as config_mod
    from ortflow.stages.build_artifacts import build
    from ortflow.stages.prepare_data import prepare

    x = np.random.default_rng(0).normal(size=(24, 3)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    config = config_mod.load(overrides={"data": {"source": str(tmp_path / "data.npz"), "shards": 1}, "model": model})
    prepare(config, tmp_path / "train", tmp_path / "eval")
    return build(config, tmp_path / "train", tmp_path / "artifacts")


def test_an_output_of_n_by_1_against_a_flat_float_label_is_reshaped_not_broadcast(tmp_path, caplog):
    """mse of [N, 1] against [N] broadcast to [N, N] without a word: the loss is now the per-record one."""
    from onnxruntime.training import api

    weight = linear_model(tmp_path / "linear.onnx", 1, [1])
    y = np.random.default_rng(2).normal(size=24).astype(np.float32)
    with caplog.at_level("WARNING", logger="ortflow.build_artifacts"):
        build_on(tmp_path, y, {"kind": "onnx", "path": str(tmp_path / "linear.onnx"), "loss": "mse"})
    assert ("the model's logits 'out' are [batch, 1] and the data's label 'y' is [batch]: the logits are reshaped "
            "to [batch] for model.loss mse (they differ in size-1 dimensions only)") in caplog.text
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "artifacts/checkpoint"))
    module = api.Module(str(tmp_path / "artifacts/training_model.onnx"), state, str(tmp_path / "artifacts/eval_model.onnx"))
    module.eval()
    batch = ShardReader(tmp_path / "eval").gather(np.arange(4))
    loss, logits = module(batch["x"], batch["y"])
    assert logits.shape == (4, 1)
    expected = ((batch["x"].astype(np.float64) @ weight)[:, 0] - batch["y"]) ** 2
    assert float(loss) == pytest.approx(expected.mean(), rel=1e-5)


@pytest.mark.parametrize("outputs, shape, message", [
    (30, [3, 10], "the model's output 'out' is [batch, 3, 10] but model.loss cross_entropy with the data's label 'y' "
                  "([batch], 3 classes) needs [batch, 3]; end the model with one score per class in dimension 1 "
                  "(classes first, then the label's own dimensions), or reshape the label to fit"),
    (2, [2], "the model's output 'out' is [batch, 2] but model.loss cross_entropy with the data's label 'y' "
             "([batch], 3 classes) needs [batch, 3]; end the model with one score per class"),
])
def test_an_output_that_does_not_fit_the_label_is_refused_naming_both_shapes(tmp_path, outputs, shape, message):
    from ortflow.errors import ModelError

    linear_model(tmp_path / "linear.onnx", outputs, shape)
    with pytest.raises(ModelError) as error:
        build_on(tmp_path, np.arange(24) % 3, {"kind": "onnx", "path": str(tmp_path / "linear.onnx")})
    assert str(error.value).startswith(message), str(error.value)
    assert not (tmp_path / "artifacts").exists()


def test_a_loss_that_fails_on_the_shapes_at_run_time_names_both_and_onnx_runtimes_words(tmp_path):
    """Where shape inference cannot tell the output's shape, the smoke step finds the misfit: its message
    gives both shapes (the output's from the forward model run alone) and ONNX Runtime's assertion without its
    source path and C++ signature, which cut the message off (`... const onn`)."""
    from ortflow.graphs.smoke_step import smoke_step_error

    linear_model(tmp_path / "linear.onnx", 30, [3, 10])
    batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros(4, np.int64)}
    ort_text = (  # what ONNX Runtime 1.19.2 raised for the SqueezeNet of onnx's test data on a flat label
        "/onnxruntime_src/orttraining/orttraining/training_api/module.cc:632 onnxruntime::common::Status "
        "onnxruntime::training::api::Module::TrainStep(const std::vector<OrtValue>&, std::vector<OrtValue>&) "
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
        "SoftmaxCrossEntropyLoss node. Name:'onnx::SoftmaxCrossEntropyLoss::4' Status Message: "
        "/onnxruntime_src/orttraining/orttraining/training_ops/cpu/loss/softmax_cross_entropy_loss.cc:62 void "
        "onnxruntime::contrib::VerifyLogitWeightAndLabelShape(const onnxruntime::TensorShape&, const "
        "onnxruntime::TensorShape&, const onnxruntime::TensorShape*) logit_shape.NumDimensions() == label_dims + 1 "
        "was false. logit_shape must be (1 + label_shape)")
    error = smoke_step_error(RuntimeError(ort_text), batch, shard_manifest([("x", "float32", [3])]), tmp_path / "linear.onnx")
    assert str(error) == (
        "the model's output is [4, 3, 10] and the data's label 'y' is [4] on a batch of 4 records, which model.loss "
        "cannot take (logit_shape.NumDimensions() == label_dims + 1 was false. logit_shape must be (1 + label_shape)); "
        "the logits must be [batch, classes, *label dims] for cross_entropy, the label's shape for the other losses")
