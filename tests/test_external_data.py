"""external_data.py and ONNX Runtime's checkpoint external data (checkpoints/ort_format.py):
models and checkpoints whose tensors go to a `.data` file beside them, forced on small
models with ORTFLOW_EXTERNAL_DATA_BYTES, through every stage."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from conftest import merged_meta, run_snakemake
from ortflow import cli, external_data
from ortflow.checkpoints import ort_format
from ortflow.checkpoints.reader import read_checkpoint
from ortflow.errors import CheckpointError, ConfigError, ModelError

FORCED = {external_data.VARIABLE: "0"}  # every tensor of 1 KiB or more to external data


def state() -> ort_format.TrainingState:
    w = np.arange(600, dtype=np.float32).reshape(20, 30)
    b = np.linspace(-1, 1, 30, dtype=np.float32)
    return ort_format.TrainingState(
        {"w": w, "b": b, "frozen": np.ones(7, np.float32)}, {"w": True, "b": True, "frozen": False},
        {"w": {"momentum0": w / 2, "momentum1": w / 3}, "b": {"momentum0": b / 2, "momentum1": b / 3}},
        {"group_name": "group0", "step": 12, "initial_learning_rate": 0.25}, {"best": 0.5, "run": "x", "n": 3})


def assert_same(a: ort_format.TrainingState, b: ort_format.TrainingState) -> None:
    assert a.parameters.keys() == b.parameters.keys() and a.requires_grad == b.requires_grad
    for name in a.parameters:
        np.testing.assert_array_equal(a.parameters[name], b.parameters[name])
        for moment, array in a.optimizer_states.get(name, {}).items():
            np.testing.assert_array_equal(array, b.optimizer_states[name][moment])
    # ONNX Runtime's checkpoint holds floats as float32, the shards as float64.
    assert single(a.optimizer) == single(b.optimizer) and single(a.properties) == single(b.properties)


def single(values: dict) -> dict:
    return {key: np.float32(value) if isinstance(value, float) else value for key, value in values.items()}


def test_checkpoint_over_the_threshold_keeps_its_tensors_in_a_data_file_that_onnx_runtime_reads(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setenv(external_data.VARIABLE, "1000")
    path = tmp_path / "checkpoint"
    assert ort_format.write_ort_checkpoint(path, state())
    data = external_data.data_file(path)
    # 600 + 2 x 600 + 30 + 2 x 30 + 7 floats, each tensor aligned to 4 bytes: all of it in the data file.
    assert data.stat().st_size == 4 * (3 * 600 + 3 * 30 + 7)
    assert path.stat().st_size < 2000
    assert_same(ort_format.read_ort_checkpoint(path), state())
    # ONNX Runtime itself loads it, optimizer state included.
    assert_same(ort_format.training_state(ort_format.ort_state(state())), state())

    monkeypatch.setenv(external_data.VARIABLE, str(10**9))
    assert not ort_format.write_ort_checkpoint(path, state())
    assert not data.exists()  # the earlier write's data file is gone, not left to mislead
    assert_same(ort_format.read_ort_checkpoint(path), state())


def test_a_checkpoint_whose_data_file_is_short_a_link_or_missing_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(external_data.VARIABLE, "0")
    path = tmp_path / "checkpoint"
    ort_format.write_ort_checkpoint(path, state())
    data = external_data.data_file(path)
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"checkpoint: tensor '\w+' lies at bytes \d+\.\.\d+ of .*checkpoint"
                                              r"\.data, which has 100 bytes; the checkpoint and its data file"):
        ort_format.read_ort_checkpoint(path)
    data.unlink()
    data.symlink_to(tmp_path / "elsewhere.bin")
    (tmp_path / "elsewhere.bin").write_bytes(bytes(100_000))
    with pytest.raises(CheckpointError, match=r"checkpoint\.data: the external data of checkpoint .* is a link"):
        ort_format.read_ort_checkpoint(path)
    data.unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint\.data: not there \(an ONNX Runtime checkpoint with "
                                              "external data\\)"):
        ort_format.read_ort_checkpoint(path)


def test_a_threshold_that_is_not_a_number_of_bytes_is_refused(monkeypatch):
    monkeypatch.setenv(external_data.VARIABLE, "2GB")
    with pytest.raises(ConfigError, match="ORTFLOW_EXTERNAL_DATA_BYTES='2GB': must be a whole number of bytes"):
        external_data.threshold()


def small_model() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.arange(512, dtype=np.float32).reshape(16, 32), "weight")
    shape = numpy_helper.from_array(np.array([-1, 32], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"])],
        "small", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["batch", 32])], [weight, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def test_a_model_over_the_threshold_is_saved_with_one_data_file_named_for_its_final_name(tmp_path, monkeypatch):
    monkeypatch.setenv(external_data.VARIABLE, "0")
    final, tmp = tmp_path / "model.onnx", tmp_path / "model.onnx.tmp"
    (tmp_path / "model.onnx.data").write_bytes(b"stale" * 1000)  # onnx would append after it
    assert external_data.save_model(small_model(), tmp, final)
    external_data.replace(tmp, final)
    assert external_data.data_file(final).stat().st_size == 512 * 4  # the weight; the 16-byte shape stays inline
    loaded = external_data.load_model(final)
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]),
                                  numpy_helper.to_array(small_model().graph.initializer[0]))

    monkeypatch.setenv(external_data.VARIABLE, str(10**9))
    assert not external_data.save_model(small_model(), tmp, final)
    external_data.replace(tmp, final)
    assert not external_data.data_file(final).exists()  # the earlier model's data file does not outlive it


def test_a_model_whose_data_file_is_a_link_out_of_its_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(external_data.VARIABLE, "0")
    folder = tmp_path / "export"
    folder.mkdir()
    external_data.save_model(small_model(), folder / "model.onnx")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(external_data.data_file(folder / "model.onnx").read_bytes())
    external_data.data_file(folder / "model.onnx").unlink()
    external_data.data_file(folder / "model.onnx").symlink_to(secret)
    with pytest.raises(ModelError, match=r"initializer 'weight' has its data in 'model\.onnx\.data', which is a "
                                         r"file outside the model's folder"):
        external_data.load_model(folder / "model.onnx")


@pytest.mark.e2e
def test_every_stage_runs_with_external_data(workdir, monkeypatch, capsys):
    """The default MLP with ORTFLOW_EXTERNAL_DATA_BYTES=0: every ONNX model and ONNX Runtime
    checkpoint ortflow writes keeps its weights in a `.data` file beside it, and the run
    goes through build, train, merge, export, quantize and `checkpoint inspect`."""
    run_snakemake(workdir, {"train": {"steps": 20, "eval_every": 10, "checkpoint_every": 10}}, env=FORCED)
    results = workdir / "results/digits"
    for model in ("artifacts/inference_base.onnx", "export/model.onnx", "export/model.int8.onnx"):
        loaded = external_data.load_model(results / model, load_data=False)
        big = [t.name for t in loaded.graph.initializer if np.prod(t.dims) * 4 >= external_data.INLINE_BYTES]
        assert big and all(onnx.external_data_helper.uses_external_data(t) for t in loaded.graph.initializer
                           if t.name in big), model
    for checkpoint in ("artifacts/checkpoint", "checkpoint/checkpoint"):
        assert external_data.data_file(results / checkpoint).stat().st_size > 1_000_000  # 330k weights (x3 merged)
    merged = ort_format.read_ort_checkpoint(results / "checkpoint/checkpoint")
    shards = read_checkpoint(results / "train/checkpoints/step-00000020").state
    assert_same(merged, shards)
    # The exported weights are the merged checkpoint's (the MLP's Gemm weights keep their names).
    exported = {t.name: numpy_helper.to_array(t, str(results / "export"))
                for t in external_data.load_model(results / "export/model.onnx").graph.initializer}
    trained = {name: array for name, array in merged.parameters.items() if name in exported}
    assert trained and all(np.array_equal(exported[name], array) for name, array in trained.items())
    metrics = json.loads((results / "export/metrics.json").read_text())
    assert metrics["int8"]["size_bytes"] == external_data.model_bytes(results / "export/model.int8.onnx")
    # `ortflow checkpoint inspect` (cli.main, which the console script calls) here, in the folder of the run.
    monkeypatch.setenv(external_data.VARIABLE, FORCED[external_data.VARIABLE])
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    assert cli.main(["checkpoint", "inspect", str(results / "train/checkpoints"),
                     "--artifacts", "results/digits/artifacts"]) == 0
    inspect = capsys.readouterr().out
    assert "step 20, 2 shards (checksums verified)" in inspect
    assert f"checked against the model {Path('results/digits/artifacts')}" in inspect


def test_artifacts_with_external_data_equal_those_without(tmp_path, monkeypatch):
    """The same graphs, byte for byte, and the same initial weights; ONNX Runtime's blocks
    leave none of the copies they save on the way, neither in the artifacts nor where the
    command ran."""
    from test_artifacts import SMALL, config

    from ortflow.stages import build_artifacts
    from ortflow.artifacts import Artifacts
    from ortflow.stages.prepare_data import prepare

    prepare(config(), tmp_path / "train", tmp_path / "eval")
    monkeypatch.chdir(tmp_path)
    build_artifacts.build(config(SMALL["mlp"]), Path("train"), Path("inline"))
    monkeypatch.setenv(external_data.VARIABLE, "0")
    build_artifacts.build(config(SMALL["mlp"]), Path("train"), Path("external"))
    inline, external = Artifacts(tmp_path / "inline"), Artifacts(tmp_path / "external")
    for graph in (*inline.graphs, inline.model_json):
        assert graph.read_bytes() == (external.folder / graph.name).read_bytes(), graph.name
    assert sorted(p.name for p in external.folder.iterdir()) == sorted(
        [p.name for p in inline.folder.iterdir()] + ["checkpoint.data", "inference_base.onnx.data"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "external", "inline", "train"]
    assert_same(ort_format.read_ort_checkpoint(external.checkpoint), ort_format.read_ort_checkpoint(inline.checkpoint))


# Run in a fresh process with the libraries loaded, so that the rise of VmHWM over the resident
# memory (VmHWM reset by clear_refs 5) is what the stage held beyond them.
PEAK_OF_STAGE = """
import json
import sys
from pathlib import Path

import onnx
import onnxruntime.tools.symbolic_shape_infer
import onnxruntime.training.api
import torch

from ortflow import config
from ortflow.stages import build_artifacts, export_model

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

open("/proc/self/clear_refs", "w").write("5")
start = status("VmRSS")
if sys.argv[2] == "build":
    built = build_artifacts.build(config.load(overrides=json.loads(sys.argv[1])), Path("train"), Path("artifacts"))
else:
    export_model.export(config.load(overrides=json.loads(sys.argv[1])), Path("artifacts"), Path("merged"),
                        Path("eval"), Path("export/model.onnx"))
print(status("VmHWM") - start)
"""


def test_build_artifacts_and_export_model_hold_the_weights_about_once(tmp_path):
    """A 101M-parameter gpt (W = 404 MB) over the threshold. build_artifacts holds its torch
    module, then its weights copied into the exported graph once; ONNX Runtime's
    generate_artifacts on the graph alone; the smoke step's weights and gradients. 2.57 W
    measured (the code before held about 8 W: torch's exporter's copies, generate_artifacts'
    and the module kept alive by a traceback to the end); 2.39 W on a 554M gpt, where the
    process's own memory counts for less (docs/benchmarks.md). export_model, of the artifacts'
    initial weights as the merged checkpoint, writes them one tensor at a time and each check
    holds them once: 1.82 W measured, the reference evaluator's activations included (before,
    ONNX Runtime's export_model_for_inferencing held 3 W and each check session 2 W). Then the
    gpt's generation folder (issue 41): its torch module, built on the meta device on the
    checkpoint's mapped arrays themselves (1 W), is exported as a decoder graph whose weights go to
    its file one at a time, generates with transformers, and is let go before the decoder's session
    opens for the check; the same for the starting weights' samples. 2.02-2.07 W measured, at the
    check session's creation (ONNX Runtime folds the Transposes of the weights) or at the decoder's
    export (2.84 W when the module and the decoder's session met, on the 0.8 W of freed memory
    that glibc's heap kept after the checks)."""
    import shutil
    import sys

    from test_artifacts import config

    from ortflow.stages.prepare_data import prepare

    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    prepare(config(data={"source": str(tmp_path / "corpus.txt"), "context": 8}), tmp_path / "train", tmp_path / "eval")
    overrides = json.dumps({"data": {"source": "text"}, "model": {"kind": "gpt", "layers": 8, "heads": 8,
                                                                   "width": 1024}})

    def held(stage: str) -> int:
        done = subprocess.run([sys.executable, "-c", PEAK_OF_STAGE, overrides, stage], cwd=tmp_path,
                              env={**os.environ, **FORCED}, capture_output=True, text=True, check=True)
        return int(done.stdout.split()[-1])

    built = held("build")
    weight_bytes = (tmp_path / "artifacts" / "inference_base.onnx.data").stat().st_size
    assert weight_bytes > 400e6
    assert built < 3.5 * weight_bytes, f"build_artifacts held {built / weight_bytes:.2f} times the weights"
    (tmp_path / "merged").mkdir()
    for name in ("checkpoint", "checkpoint.data"):
        shutil.copy(tmp_path / "artifacts" / name, tmp_path / "merged" / name)
    merged_meta(tmp_path / "merged", 0)
    exported = held("export")
    assert exported < 2.5 * weight_bytes, f"export_model held {exported / weight_bytes:.2f} times the weights"
    assert (tmp_path / "export" / "model.onnx.data").stat().st_size == weight_bytes
