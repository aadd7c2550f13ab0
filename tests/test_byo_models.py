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

from conftest import run_snakemake
from ortflow.errors import ModelError
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
    assert "the output 'softmaxout_1' comes from Softmax node" in build_log
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


def test_model_zoo_resnet50_is_adapted_then_stops_in_ort_backward(tmp_path):
    """The light ResNet-50 of onnx's test data (Caffe2's: opset 9, BatchNorms in
    inference mode, residual Sums, a data-queue initializer no node reads, a
    Reshape to [1, 2048]) gets through every adaptation; then ONNX Runtime
    1.19.2's backward pass fails on it, and the stage says so in one line naming
    the node, instead of blaming the loss."""
    import subprocess
    import sys

    import yaml

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", **{"gpu_0/data_0": rng.random((8, 3, 224, 224), dtype=np.float32),
                                          "y": np.arange(8) % 2})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "data": {"source": "images.npz", "features": ["gpu_0/data_0"], "shards": 1},
        "model": {"kind": "onnx", "path": str(SQUEEZENET.with_name("light_resnet50.onnx"))},
    }))

    def ortflow(*arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ortflow.cli", *arguments, "--config", "config.yaml"],
                              cwd=tmp_path, capture_output=True, text=True)

    assert ortflow("prepare-data", "--train", "data/train", "--eval", "data/eval").returncode == 0
    built = ortflow("build-artifacts", "--train", "data/train", "--out", "artifacts")
    assert built.returncode == 1 and not (tmp_path / "artifacts").exists()
    for change in ("1 initializer(s) that no node reads removed: ['gpu_0/imagenet1k_blobs_queue_",
                   "16 Sum node(s) written as Add", "Reshape node(s) ['n173'] to a fixed batch of 1 now reshape",
                   "7 BatchNormalization nodes switched to training mode"):
        assert change in built.stderr, change
    error = built.stderr.strip().splitlines()[-1]
    assert error.startswith("ortflow build-artifacts: error: ONNX Runtime's backward pass fails at its node "
                            "'AccumulateGrad_r161_grad' (Sum) on a batch of 4 records: "), error
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
