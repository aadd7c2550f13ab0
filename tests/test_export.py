"""The export_model and quantize_model stages through the real workflow: the
inference model and its checks, int8 quality, size and latency report, the
quality gate, a user ONNX model; and the losses of an inference model's logits.
How much faster int8 runs is measured by bench/bench_quantize.py
(docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import export_metrics, gate_judged, model_description, run_snakemake
from ortflow import config as config_mod
from ortflow.data.shards import ShardReader

SHORT = {"train": {"steps": 150}}
# The user model: 64 -> 512 -> 512 -> 10 (the default MLP's shape),
# with one outlier weight on pixel 0, which is 0 in every digit: it changes
# nothing in float, and per tensor it sets the int8 step of the whole first layer.
OUTLIER = 500.0


def _export(workdir: Path, run: str = "digits") -> Path:
    return workdir / "results" / run / "export"


def _metrics(workdir: Path, run: str = "digits") -> dict:
    return json.loads((_export(workdir, run) / "metrics.json").read_text())


def _log(workdir: Path, rule: str, run: str = "digits") -> str:
    return (workdir / "logs" / run / f"{rule}.log").read_text()


def _rules_run(result) -> list[str]:
    return re.findall(r"^(?:local)?rule (\w+):", result.stderr, re.M)


def write_user_model(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, initializers, previous, width = [], [], "x", 64
    sizes = [512, 512, 10]
    for i, size in enumerate(sizes):
        weight = (rng.standard_normal((width, size)) * np.sqrt(2 / width)).astype(np.float32)
        if i == 0:
            weight[0, 0] = OUTLIER
        initializers += [numpy_helper.from_array(weight, f"w{i}"), numpy_helper.from_array(np.zeros(size, np.float32), f"b{i}")]
        last = i == len(sizes) - 1
        nodes += [helper.make_node("MatMul", [previous, f"w{i}"], [f"mm{i}"]),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], ["scores" if last else f"pre{i}"])]
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{i}"], [f"h{i}"]))
        previous, width = f"h{i}", size
    graph = helper.make_graph(nodes, "user_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 10])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(path))


# A gate that refuses every int8 model (int8 can gain at most 100 points): its outcome does not depend
# on where int8 lands, which differs by CPU (int8 kernels round differently with and without AVX-512 VNNI).
REFUSING_GATE = -1000.0


@pytest.fixture(scope="module")
def user_run(tmp_path_factory) -> tuple[Path, dict, object]:
    """A user ONNX model trained through the pipeline, quantized per tensor (the default), its int8
    model refused by the gate."""
    workdir = tmp_path_factory.mktemp("user")
    workdir.mkdir(exist_ok=True)
    write_user_model(workdir / "user_mlp.onnx")
    config = {"run": {"name": "user"}, "model": {"kind": "onnx", "path": "user_mlp.onnx"}, **SHORT,
              "export": {"max_accuracy_drop": REFUSING_GATE}}
    result = run_snakemake(workdir, config, check=False)
    return workdir, config, result


@pytest.mark.e2e
def test_exported_model_is_the_trained_inference_graph(default_run):
    import onnx
    import onnxruntime as ort

    path = _export(default_run) / "model.onnx"
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["x"] and [o.name for o in model.graph.output] == ["logits"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    assert {n.op_type for n in model.graph.node} <= {"Flatten", "Cast", "Gemm", "Relu", "Reshape"}
    meta = json.loads((default_run / "results/digits/checkpoint/meta.json").read_text())
    props = {p.key: p.value for p in model.metadata_props}
    assert props == {"ortflow.run": "digits", "ortflow.step": "300", "ortflow.checkpoint": "last",
                     "ortflow.version": "0.1.0", "ortflow.identity_digest": meta["identity_digest"]}
    # The trained weights: its accuracy on the eval split is the one training reported.
    reader = ShardReader(default_run / "results/digits/data/eval")
    batch = reader.gather(np.arange(len(reader)))
    logits = ort.InferenceSession(str(path)).run(None, {"x": batch["x"]})[0]
    trained = json.loads((default_run / "results/digits/train/metrics.json").read_text())["eval"]["accuracy"]
    assert (logits.argmax(1) == batch["y"]).mean() == pytest.approx(trained, abs=1e-9)
    log = _log(default_run, "export_model")
    # Same weights, same operators; the inference graph's kernels may sum in another order.
    difference = re.search(r"logits within ([0-9.e+-]+) of the eval graph's", log)
    assert difference and float(difference.group(1)) <= 1e-4, log
    assert "ONNX reference evaluator agrees with ONNX Runtime on 8 records" in log
    assert not list(_export(default_run).glob("*.tmp"))


@pytest.mark.e2e
def test_int8_is_evaluated_gated_and_3x_smaller(default_run):
    metrics = _metrics(default_run)
    fp32, int8 = metrics["fp32"], metrics["int8"]
    assert metrics["quantize"] == "dynamic" and metrics["threads"] == 1
    trained = json.loads((default_run / "results/digits/train/metrics.json").read_text())["eval"]
    assert fp32["accuracy"] == pytest.approx(trained["accuracy"]) and fp32["loss"] == pytest.approx(trained["loss"])
    assert fp32["accuracy"] >= 0.93, fp32
    assert int8["size_bytes"] == (_export(default_run) / "model.int8.onnx").stat().st_size
    assert fp32["size_bytes"] >= 3 * int8["size_bytes"], (fp32["size_bytes"], int8["size_bytes"])
    for entry in (fp32, int8):
        latency = entry["latency_ms"]
        assert sorted(latency) == ["b1_p50", "b1_p95", "b64_p50", "b64_p95"]
        assert 0 < latency["b1_p50"] <= latency["b1_p95"] and 0 < latency["b64_p50"] <= latency["b64_p95"]
    gate = metrics["gate"]
    assert (gate["metric"], gate["unit"], gate["max_accuracy_drop"]) == ("accuracy", "points", 1.0)
    assert gate["drop"] == pytest.approx((fp32["accuracy"] - int8["accuracy"]) * 100)
    log = _log(default_run, "quantize_model")
    assert re.search(r"accuracy \(%\)\s+[\d.]+\s+[\d.]+\s+[+-]", log), log
    assert "x smaller" in log and "x faster" in log and gate_judged(gate, log), (gate, log[-2000:])


@pytest.mark.e2e
def test_quantize_none_reports_fp32_only(default_run, tmp_path):
    workdir = tmp_path / "none"
    shutil.copytree(default_run, workdir, symlinks=True)
    result = run_snakemake(workdir, {"export": {"quantize": "none"}})
    assert "quantize_model" in _rules_run(result)
    metrics = _metrics(workdir)
    assert "int8" not in metrics and metrics["fp32"]["accuracy"] == _metrics(default_run)["fp32"]["accuracy"]
    assert not (_export(workdir) / "model.int8.onnx").exists()


@pytest.mark.e2e
def test_a_refused_int8_model_is_said_and_fails_the_run_only_when_asked(user_run):
    workdir, config, result = user_run
    assert result.returncode == 0, result.stderr[-3000:]
    log = _log(workdir, "quantize_model", "user")
    match = re.search(r"WARNING quality gate: int8 accuracy ([\d.]+) against fp32 ([\d.]+) is a loss of ([\d.-]+) "
                      r"points, more than export.max_accuracy_drop=-1000.0 \(one of the \d+ eval records is [\d.]+ "
                      r"points\); the int8 model is refused \(metrics.json: gate outcome refused\): deploy the fp32 model "
                      r"results/user/export/model.onnx \(try export.quantize: static; export.per_channel: true; ", log)
    assert match, log[-3000:]
    int8, fp32, drop = map(float, match.groups())
    # All three are printed to 4 digits (0.01 points here): the printed difference may be 0.015 off.
    assert fp32 >= 90 and drop == pytest.approx(fp32 - int8, abs=0.015 + 1e-9)
    metrics = _metrics(workdir, "user")
    assert metrics["gate"] == {"metric": "accuracy", "unit": "points", "max_accuracy_drop": REFUSING_GATE,
                               "outcome": "refused", "drop": pytest.approx(fp32 - int8, abs=0.015)}
    # The console's summary and the report's table say so; the int8 file is not offered.
    said = f"refused by the gate, {-metrics['gate']['drop']:+.3g} points (export.max_accuracy_drop: -1000)"
    assert "  model     results/user/export/model.onnx\n" in result.stdout, result.stdout
    assert f"  int8      {said}: deploy the fp32 model" in result.stdout
    assert f"<tr data-key='gate'><td>int8</td><td class=n>{said}</td></tr>" in (
        workdir / "results" / "user" / "report" / "summary.html").read_text()

    # export.gate_fails_run: the stage fails with the same numbers, and leaves no int8 model and no metrics.json.
    failing = run_snakemake(workdir, {**config, "export": {**config["export"], "gate_fails_run": True}}, check=False)
    assert failing.returncode != 0
    assert re.search(r"quality gate: int8 accuracy [\d.]+ against fp32 [\d.]+ is a loss of [\d.-]+ points, more "
                     r"than export.max_accuracy_drop=-1000.0 .*; no int8 model is written and the fp32 model "
                     r"results/user/export/model.onnx stays \(export.gate_fails_run\)", failing.stderr)
    assert (_export(workdir, "user") / "model.onnx").is_file()
    assert not (_export(workdir, "user") / "model.int8.onnx").exists()
    assert not (_export(workdir, "user") / "metrics.json").exists()


@pytest.mark.e2e
def test_user_onnx_model_quantizes_per_channel(user_run):
    """Per channel, the outlier only coarsens its own column: the gate passes."""
    import onnx

    workdir, config, _ = user_run
    result = run_snakemake(workdir, {**config, "export": {"per_channel": True}})
    assert "quantize_model" in _rules_run(result)
    model = onnx.load(str(_export(workdir, "user") / "model.int8.onnx"))
    props = {p.key: p.value for p in model.metadata_props}
    assert props["ortflow.run"] == "user" and props["ortflow.quantize"] == "dynamic"
    metrics = _metrics(workdir, "user")
    fp32, int8 = metrics["fp32"], metrics["int8"]
    assert metrics["per_channel"] is True
    assert fp32["accuracy"] >= 0.9 and fp32["accuracy"] - int8["accuracy"] <= 0.01, (fp32, int8)
    assert fp32["size_bytes"] >= 3 * int8["size_bytes"]


@pytest.mark.e2e
def test_400_steps_export_within_the_scaled_tolerance(digits_workdir):
    """The default config trained longer: its weights grow. The check's session, without
    pre-packing, gives the eval graph's logits bit for bit (the same kernels on the same
    weights); ONNX's reference evaluator sums in another float32 order, by more than the
    absolute 1e-6 and within the tolerance scaled to the logits."""
    run_snakemake(digits_workdir, {"train": {"steps": 400}}, "export_model")
    log = _log(digits_workdir, "export_model")
    match = re.search(r"logits within ([0-9.e+-]+) of the eval graph's", log)
    assert match and float(match.group(1)) == 0, log
    reference = re.search(r"agrees with ONNX Runtime on 8 records: largest difference ([0-9.e+-]+) "
                          r"\(allowed: ([0-9.e+-]+)\)", log)
    assert reference and 1e-6 < float(reference.group(1)) <= float(reference.group(2)), log
    assert (_export(digits_workdir) / "model.onnx").is_file()


def test_scaled_tolerance_names_the_allowance():
    from ortflow.export.checks import ExportError, compare

    large = np.array([[100.0, -20.0]], np.float32)
    assert compare("logits", large + np.float32(5e-3), large) == pytest.approx(5e-3, rel=1e-3)  # allowed 0.010001
    with pytest.raises(ExportError, match=r"logits: shapes \[1, 2\] and \[1, 2\], largest difference 0\.02 "
                                          r"\(allowed: 0\.01 = 0\.0001 x the largest \|value\| \+ 1e-06\)"):
        compare("logits", large + np.float32(2e-2), large)
    with pytest.raises(ExportError, match="largest difference inf"):
        compare("logits", np.full((1, 2), np.nan, np.float32), large)


def test_reference_evaluator_failure_warns_and_names_the_operator(tmp_path, caplog):
    """onnx 1.17's GatherElements fails on a 3-d gather along more than 64 entries,
    which ONNX Runtime evaluates correctly: a warning naming the node, not a failed export."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from ortflow.export.checks import check_reference

    indices = numpy_helper.from_array(np.array([[[5, 70, 99], [0, 1, 2]]], np.int64), "picked")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"], name="relu"),
         helper.make_node("GatherElements", ["h", "picked"], ["g"], name="pick", axis=2),
         helper.make_node("Flatten", ["g"], ["logits"], name="flat")],
        "gather", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 100])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 6])], [indices])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    path = tmp_path / "gather.onnx"
    onnx.save(model, str(path))
    feeds = {"x": np.arange(200, dtype=np.float32).reshape(1, 2, 100)}
    logits = ort.InferenceSession(str(path)).run(None, feeds)[0]
    assert logits.tolist() == [[5, 70, 99, 100, 101, 102]]
    with caplog.at_level("WARNING", logger="ortflow.export"):
        check_reference(path, feeds, logits)
    assert "ONNX's reference evaluator fails (ValueError" in caplog.text
    assert "at node 'pick' (operator GatherElements), while ONNX Runtime's eval graph agrees" in caplog.text


@pytest.mark.parametrize("gather", [False, True])
def test_reference_evaluator_reads_weights_in_external_data(tmp_path, caplog, gather):
    """A model whose weights are in external data: the reference evaluator is fed them as inputs,
    and agrees, or (GatherElements, as above) names the node where it does not."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from ortflow.export.checks import check_reference

    weight = numpy_helper.from_array(np.linspace(-1, 1, 100 * 100, dtype=np.float32).reshape(100, 100), "w")
    indices = numpy_helper.from_array(np.array([[[5, 70, 99], [0, 1, 2]]], np.int64), "picked")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")]
    if gather:
        nodes += [helper.make_node("GatherElements", ["h", "picked"], ["logits"], name="pick", axis=2)]
    else:
        nodes += [helper.make_node("Relu", ["h"], ["logits"], name="relu")]
    graph = helper.make_graph(nodes, "external", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 100])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], [weight, indices])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    assert onnx.load(str(path), load_external_data=False).graph.initializer[0].data_location == TensorProto.EXTERNAL
    feeds = {"x": np.arange(200, dtype=np.float32).reshape(1, 2, 100) / 200}
    logits = ort.InferenceSession(str(path)).run(None, feeds)[0]
    with caplog.at_level("INFO", logger="ortflow.export"):
        check_reference(path, feeds, logits)
    if gather:
        assert "at node 'pick' (operator GatherElements), while ONNX Runtime's eval graph agrees" in caplog.text
    else:
        assert "ONNX reference evaluator agrees with ONNX Runtime on 1 records" in caplog.text


@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_inference_graph_is_what_onnx_runtimes_export_writes(kind, tmp_path):
    """export_model writes the inference graph itself, from the eval graph and the checkpoint's
    tensors one at a time (graphs/inference_model.py); ONNX Runtime's
    Module.export_model_for_inferencing, which it replaces, writes the same nodes, initializers,
    inputs and output, and the two models compute the same logits bit for bit."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from onnxruntime.training.api import CheckpointState, Module

    from test_artifacts import build, config

    from ortflow.checkpoints.ort_format import read_ort_checkpoint
    from ortflow.graphs import inference_model
    from ortflow.stages.prepare_data import prepare

    text = {"source": str(tmp_path / "corpus.txt"), "context": 8} if kind == "gpt" else {}
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    prepare(config(data=text), tmp_path / "train", tmp_path / "eval")
    model = {"kind": "gpt", "layers": 2, "heads": 2, "width": 32} if kind == "gpt" else {"kind": "cnn"}
    artifacts = tmp_path / "artifacts"
    info = build(tmp_path / "train", artifacts, model)
    output = info.outputs.logits
    module = Module(str(artifacts / "training_model.onnx"), CheckpointState.load_checkpoint(str(artifacts / "checkpoint")),
                    str(artifacts / "eval_model.onnx"))
    with contextlib.chdir(tmp_path):
        module.export_model_for_inferencing("theirs.onnx", [output])
    ours = inference_model.inference_graph(artifacts / "eval_model.onnx", output)
    inference_model.add_weights(ours, read_ort_checkpoint(artifacts / "checkpoint").parameters, tmp_path / "ours.onnx",
                                tmp_path / "ours.onnx")
    onnx.save(ours, str(tmp_path / "ours.onnx"))
    theirs = onnx.load(str(tmp_path / "theirs.onnx"))

    def nodes(model):
        return sorted((node.op_type, node.domain, list(node.input), list(node.output)) for node in model.graph.node)

    def initializers(model):
        return {tensor.name: numpy_helper.to_array(tensor).tolist() for tensor in model.graph.initializer}

    assert len(ours.graph.node) > 5 and nodes(ours) == nodes(theirs)
    assert initializers(ours) == initializers(theirs)
    assert [value.name for value in ours.graph.input] == [value.name for value in theirs.graph.input]
    assert ours.graph.output == theirs.graph.output
    batch = ShardReader(tmp_path / "eval").gather(np.arange(4))
    logits = [ort.InferenceSession(str(tmp_path / name)).run(None, {value.name: batch[value.name] for value in
                                                                   ours.graph.input})[0]
              for name in ("ours.onnx", "theirs.onnx")]
    assert np.array_equal(*logits)


def write_conv_model(path: Path, shaped_input: bool = True) -> None:
    """x [n, 64] -> 1x8x8 -> Conv 4x3x3 -> Relu -> Flatten -> MatMul -> [n, 10]; the
    input's shape left unknown (valid ONNX) when not `shaped_input`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    initializers = [numpy_helper.from_array(np.array([-1, 1, 8, 8], np.int64), "image_shape"),
                    numpy_helper.from_array(rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32), "conv_w"),
                    numpy_helper.from_array(rng.normal(0, 0.1, (256, 10)).astype(np.float32), "head_w")]
    nodes = [helper.make_node("Reshape", ["x", "image_shape"], ["image"], name="to_image"),
             helper.make_node("Conv", ["image", "conv_w"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
             helper.make_node("Flatten", ["relu"], ["flat"], name="flatten"),
             helper.make_node("MatMul", ["flat", "head_w"], ["logits"], name="head")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64] if shaped_input else None)
    graph = helper.make_graph(nodes, "conv", [x], [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_dynamic_quantization_keeps_conv_fp32_and_survives_preprocessing(tmp_path, caplog, monkeypatch):
    """A CNN quantized dynamically: ConvInteger has no int8 CPU kernel in ORT 1.19, so
    the convolution stays fp32 (known, and found by loading the model when not known),
    and an input of unknown shape, which crashes ORT's symbolic shape inference with
    TypeError, costs that step only."""
    import onnx
    import onnxruntime as ort

    from ortflow.quantization import quantizer

    source = tmp_path / "conv.onnx"
    write_conv_model(source, shaped_input=False)
    x = np.random.default_rng(6).random((16, 64), dtype=np.float32)
    fp32 = ort.InferenceSession(str(source)).run(None, {"x": x})[0]
    export_cfg = config_mod.load(overrides={"export": {"per_channel": False}}).export
    auto = config_mod.load(overrides={"export": {"quantize": "auto"}}).export
    assert quantizer.method(auto, onnx.load(str(source))) == "static"
    for known in (("Conv",), ()):
        monkeypatch.setattr(quantizer, "NO_DYNAMIC_INT8_KERNEL", known)
        target = tmp_path / f"int8-{len(known)}.onnx"
        caplog.clear()
        with caplog.at_level("INFO", logger="ortflow.quantize"):
            quantizer.quantize_file(source, target, "dynamic", export_cfg, None, 16)
        ops = {n.op_type for n in onnx.load(str(target)).graph.node}
        assert "Conv" in ops and "ConvInteger" not in ops and "MatMulInteger" in ops, ops
        int8 = ort.InferenceSession(str(target)).run(None, {"x": x})[0]
        assert np.abs(int8 - fp32).max() <= 0.05 * np.abs(fp32).max()
        assert "TypeError: 'NoneType' object is not iterable); retrying without symbolic shape inference" in caplog.text
        if known:
            assert "kept fp32 (no int8 CPU kernel in ONNX Runtime for dynamic quantization): ['Conv']" in caplog.text
        else:
            assert "no int8 CPU kernel for node 'conv_quant' (operator Conv, dynamic quantization)" in caplog.text


# Run in a fresh process, so that the peak is the pre-processing's alone: VmHWM is reset
# (clear_refs 5) once the libraries are loaded, and the rise over the resident memory then
# is what the pre-processing held at its peak beyond them.
PEAK_OF_PREPROCESSING = """
import sys
from pathlib import Path
from ortflow.quantization.preprocess import preprocess
import onnxruntime.tools.symbolic_shape_infer, onnxruntime.quantization.quant_utils

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

folder = Path(sys.argv[1])
open("/proc/self/clear_refs", "w").write("5")
start = status("VmRSS")
preprocess(folder / "model.onnx", folder / "scratch" / "preprocessed.onnx")
print(status("VmHWM") - start)
"""


def test_quantization_preprocessing_holds_the_weights_less_than_once(tmp_path):
    """ONNX Runtime's quant_pre_process reads a model's weights whole and holds them
    through its steps (3.4 to 3.9 times the weights of this model at its peak); ortflow's keeps
    them in their external data file (0.4 times, measured on a shared 2-core machine). Each
    weight is read through a Transpose, as torch exports a Linear (MatMul(x, Transpose(w))):
    ONNX Runtime's session folding those held 3.1 times the weights of a GPT at its peak."""
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    width, layers = 2048, 6  # 100 MB of weights, far above what the process's noise is
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((width, width), dtype=np.float32), f"w{i}")
               for i in range(layers)]
    nodes = [node for i in range(layers) for node in (
        helper.make_node("Transpose", [f"w{i}"], [f"w{i}_t"]),
        helper.make_node("MatMul", [f"h{i - 1}" if i else "x", f"w{i}_t"], [f"h{i}"]))]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info(f"h{layers - 1}", TensorProto.FLOAT, ["n", width])],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data")
    (tmp_path / "scratch").mkdir()
    done = subprocess.run([sys.executable, "-c", PEAK_OF_PREPROCESSING, str(tmp_path)], capture_output=True,
                          text=True, check=True)
    held = int(done.stdout.split()[-1])
    weight_bytes = layers * width * width * 4
    assert held < weight_bytes, f"pre-processing held {held / weight_bytes:.2f} times the weights"
    preprocessed = onnx.load(str(tmp_path / "scratch" / "preprocessed.onnx"), load_external_data=False)
    assert {p.key: p.value for p in preprocessed.metadata_props}["onnx.quant.pre_process"] == "onnxruntime.quant"
    assert [node.op_type for node in preprocessed.graph.node] == ["MatMul"] * layers
    assert sorted(tensor.name for tensor in preprocessed.graph.initializer) == [f"w{i}_t" for i in range(layers)]
    assert (tmp_path / "scratch" / "preprocessed.onnx.data").stat().st_size == weight_bytes


@pytest.mark.parametrize("external", [False, True])
def test_transposed_weights_fold_as_onnx_runtime_folds_them(tmp_path, monkeypatch, external):
    """fold_transposed_weights does before ONNX Runtime's session what its constant folding
    did: the pre-processed model is the same, node for node and initializer for initializer
    (by name; their order in the file may differ), with the weights inline or in external data.
    A weight read by a Gather too stays (tied embeddings), a 3-D Transpose keeps its perm, a
    Transpose of a graph input stays, and a weight two Transposes read is left to ONNX Runtime."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ortflow.quantization import preprocess as pre

    rng = np.random.default_rng(3)
    tokens = rng.standard_normal((50, 16), dtype=np.float32)
    heads = rng.standard_normal((2, 8, 16), dtype=np.float32)
    initializers = [numpy_helper.from_array(tokens, "tokens"), numpy_helper.from_array(heads, "heads"),
                    numpy_helper.from_array(rng.standard_normal((16, 16), dtype=np.float32), "twice")]
    nodes = [helper.make_node("Gather", ["tokens", "ids"], ["embedded"]),
             helper.make_node("Transpose", ["heads"], ["heads_t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["embedded", "heads_t"], ["per_head"]),  # [n, 16] @ [2, 16, 8]
             helper.make_node("Transpose", ["twice"], ["twice_t"]),
             helper.make_node("Transpose", ["twice"], ["twice_t2"]),
             helper.make_node("MatMul", ["embedded", "twice_t"], ["once"]),
             helper.make_node("MatMul", ["embedded", "twice_t2"], ["again"]),
             helper.make_node("Transpose", ["tokens"], ["tokens_t"]),
             helper.make_node("MatMul", ["embedded", "tokens_t"], ["logits"]),
             helper.make_node("Transpose", ["mask"], ["mask_t"]),
             helper.make_node("Add", ["logits", "mask_t"], ["scores"])]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                                              helper.make_tensor_value_info("mask", TensorProto.FLOAT, [50, 1])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 50]),
                               helper.make_tensor_value_info("per_head", TensorProto.FLOAT, [2, "n", 8]),
                               helper.make_tensor_value_info("once", TensorProto.FLOAT, ["n", 16]),
                               helper.make_tensor_value_info("again", TensorProto.FLOAT, ["n", 16])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source), save_as_external_data=external, location="model.onnx.data", size_threshold=1024)

    def preprocessed(folder: str):
        (tmp_path / folder).mkdir()
        pre.pre_process(source, tmp_path / folder / "preprocessed.onnx")
        return onnx.load(str(tmp_path / folder / "preprocessed.onnx"))

    ours = preprocessed("ours")
    monkeypatch.setattr(pre, "fold_transposed_weights", lambda *args: None)
    theirs = preprocessed("theirs")

    def initializers_of(model):
        return {tensor.name: (list(tensor.dims), numpy_helper.to_array(tensor).tobytes())
                for tensor in model.graph.initializer}

    # ONNX Runtime's basic level fuses MatMul and Add into a Gemm, which needs tokens_t constant.
    assert [node.op_type for node in ours.graph.node] == ["Transpose", "Gather", "Gemm", "MatMul", "MatMul", "MatMul"]
    assert ours.graph.node == theirs.graph.node and ours.graph.value_info == theirs.graph.value_info
    assert initializers_of(ours) == initializers_of(theirs)
    assert np.array_equal(numpy_helper.to_array(next(t for t in ours.graph.initializer if t.name == "heads_t")),
                          heads.transpose(0, 2, 1))
    assert (tmp_path / "ours" / "preprocessed.onnx.data").is_file() == external


PEAK_OF_DYNAMIC_QUANTIZATION = """
import sys
from onnxruntime.quantization import QuantType, quantize_dynamic
from ortflow import ort_private

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

open("/proc/self/clear_refs", "w").write("5")
start = status("VmRSS")
with ort_private.dynamic_quantizer_reads_weights_once():
    quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8, use_external_data_format=True)
print(status("VmHWM") - start)
"""


def test_dynamic_quantization_reads_the_weights_once(tmp_path):
    """ONNXQuantizer infers shapes by saving its model and reading it back, a second copy of the
    weights (2.9 times this model's weights at quantize_dynamic's peak, 2.6 a GPT's); with its
    shape inference run on the graph alone (ort_private.dynamic_quantizer_reads_weights_once)
    it holds them once, with their int8 copy and one tensor's scratch (1.9 times, 1.5 a GPT's)."""
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    width, layers = 2048, 6  # 100 MB of weights
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((width, width), dtype=np.float32), f"w{i}")
               for i in range(layers)]
    nodes = [helper.make_node("MatMul", [f"h{i - 1}" if i else "x", f"w{i}"], [f"h{i}"]) for i in range(layers)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info(f"h{layers - 1}", TensorProto.FLOAT, ["n", width])],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    done = subprocess.run([sys.executable, "-c", PEAK_OF_DYNAMIC_QUANTIZATION, str(tmp_path / "model.onnx"),
                           str(tmp_path / "int8.onnx")], capture_output=True, text=True, check=True)
    held = int(done.stdout.split()[-1])
    weight_bytes = layers * width * width * 4
    assert held < 2.4 * weight_bytes, f"dynamic quantization held {held / weight_bytes:.2f} times the weights"
    assert (tmp_path / "int8.onnx.data").stat().st_size >= layers * width * width


@pytest.mark.parametrize("external", [False, True])
def test_dynamic_quantization_is_the_same_with_shapes_inferred_in_place(tmp_path, external):
    """ONNXQuantizer's own save-and-reload shape inference and ortflow's on the graph alone give
    the same int8 model: the CNN's Reshape reads its shape from a small initializer, which both
    see, and the MatMul and Conv weights, which neither reads."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from ortflow import ort_private

    write_conv_model(tmp_path / "model.onnx")
    model = tmp_path / "model.onnx"
    if external:
        onnx.save(onnx.load(str(model)), str(model), save_as_external_data=True, location="model.onnx.data",
                  size_threshold=64)
    for name, inferred in (("theirs", contextlib.nullcontext()), ("ours", ort_private.dynamic_quantizer_reads_weights_once())):
        with inferred:
            quantize_dynamic(str(model), str(tmp_path / f"{name}.onnx"), weight_type=QuantType.QUInt8,
                             use_external_data_format=external)
    ours, theirs = (onnx.load(str(tmp_path / f"{name}.onnx")) for name in ("ours", "theirs"))
    assert any(node.op_type == "ConvInteger" for node in ours.graph.node)
    assert ours.graph == theirs.graph and ours.metadata_props == theirs.metadata_props


def export(**keys):
    """The config's export section with `keys` set."""
    return config_mod.load(overrides={"export": keys}).export


def test_gate_on_a_tiny_eval_split_says_what_one_record_is_worth(caplog):
    from ortflow.quantization.gate import QualityGateError, gate

    report = {"fp32": {"loss": 0.1, "accuracy": 0.95}, "int8": {"loss": 0.2, "accuracy": 0.90}}
    said = (r"is a loss of 5 points, more than export.max_accuracy_drop=1.0 \(one of the 20 eval records is 5 "
            r"points\); ")
    with pytest.raises(QualityGateError, match=said + r"no int8 model is written and the fp32 model model.onnx stays "
                                               r"\(export.gate_fails_run\) \(try export.quantize: none\)$"):
        gate(report, export(max_accuracy_drop=1.0, gate_fails_run=True), Path("model.onnx"), 20,
             ["export.quantize: none"])
    # By default the run goes on: the int8 model is refused, in a warning and in the gate's entry.
    refused = gate(report, export(max_accuracy_drop=1.0, gate_fails_run=False), Path("model.onnx"), 20,
                   ["export.quantize: none"])
    assert refused == {"metric": "accuracy", "drop": pytest.approx(5.0), "unit": "points", "max_accuracy_drop": 1.0,
                       "outcome": "refused"}
    assert re.search(said + r"the int8 model is refused \(metrics.json: gate outcome refused\): deploy the fp32 "
                            r"model model.onnx \(try export.quantize: none\)$", caplog.records[-1].getMessage())
    assert caplog.records[-1].levelname == "WARNING"
    passed = gate(report, export(max_accuracy_drop=5.0, gate_fails_run=True), Path("model.onnx"), 20, [])
    assert (passed["drop"], passed["outcome"]) == (pytest.approx(5.0), "passed")


@pytest.mark.e2e
def test_user_cnn_and_its_opset_20_export_quantize_statically(digits_workdir, monkeypatch):
    """`auto` picks static QDQ for a model with convolutions (dynamic would need
    ConvInteger), for a user's torch CNN and for the same module exported by torch's
    dynamo exporter at opset 20 as an ONNX file; int8 evaluated and gated."""
    import onnx
    import torch

    from artifacts_user_model import SmallCNN

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
    train = {"steps": 60, "eval_every": 60, "checkpoint_every": 60}
    torch.manual_seed(0)
    torch.onnx.export(SmallCNN().eval(), (torch.zeros(2, 64),), str(digits_workdir / "cnn20.onnx"), input_names=["x"],
                      output_names=["logits"], opset_version=20, dynamo=True, external_data=False,
                      dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert onnx.load(str(digits_workdir / "cnn20.onnx")).opset_import[0].version == 20
    for model in ({"kind": "torch", "path": "artifacts_user_model:SmallCNN"}, {"kind": "onnx", "path": "cnn20.onnx"}):
        run_snakemake(digits_workdir, {"model": model, "train": train}, "quantize_model")
        metrics = _metrics(digits_workdir)
        assert metrics["quantize"] == "static", (model, metrics)
        assert metrics["fp32"]["accuracy"] >= 0.5 and gate_judged(metrics["gate"], _log(digits_workdir, "quantize_model"))
        assert "QuantizeLinear" in {n.op_type for n in onnx.load(str(_export(digits_workdir) / "model.int8.onnx")).graph.node}


@pytest.mark.e2e
def test_an_int8_model_larger_than_the_fp32_model_is_reported_and_not_offered(tmp_path):
    """A two-unit MLP: int8's scales, zero points and quantization nodes outweigh its few weights.
    The file is written (Snakemake wants it), but the log, metrics.json and the console say not to use it."""
    workdir = tmp_path / "work"
    config = {"run": {"name": "tiny"}, "model": {"hidden": [2]},
              "train": {"steps": 20, "eval_every": 20, "checkpoint_every": 20}, "export": {"max_accuracy_drop": 100}}
    result = run_snakemake(workdir, config)
    metrics = _metrics(workdir, "tiny")
    fp32, int8 = metrics["fp32"]["size_bytes"], metrics["int8"]["size_bytes"]
    assert int8 > fp32 and int8 == (_export(workdir, "tiny") / "model.int8.onnx").stat().st_size
    model = "results/tiny/export/model.onnx"
    warning = (f"the int8 model ({int8 / 1024:.3g} KiB) is {int8 / fp32:.3g}x the size of the fp32 model "
               f"({fp32 / 1024:.3g} KiB): on a model this small the quantization's scales, zero points and nodes "
               f"outweigh what int8 saves on the weights; deploy the fp32 model {model}, and set export.quantize: "
               "none to skip int8")
    assert metrics["warnings"] == [warning]
    assert f"WARNING {warning}" in _log(workdir, "quantize_model", "tiny")
    assert f"  warning   {warning}" in result.stdout
    assert f"  model     {model}\n" in result.stdout  # without "(int8: ...)"


def test_latency_is_timed_at_a_batch_whose_activations_fit(monkeypatch, caplog):
    """64 records, or as many as two sessions' activations (model.json's eval_bytes_per_sample)
    fit in half the memory available; the summary and the report name the batch timed."""
    from ortflow.reporting.results import speedup
    from ortflow.reporting.tables import summary_rows
    from ortflow.quantization.measure import latency_batches

    monkeypatch.setenv("ORTFLOW_MEMORY_AVAILABLE", str(4 * 10**9))
    with caplog.at_level("INFO", logger="ortflow.quantize"):
        assert latency_batches(model_description(eval_bytes_per_sample=100 * 10**6), sessions=2) == (1, 10)
    assert "latency timed at batch 1 and 10, not 64: 2 session(s) of 100 MB a record in half the 3.7 GiB " \
           "available (ORTFLOW_MEMORY_AVAILABLE)" in caplog.text
    assert latency_batches(model_description(eval_bytes_per_sample=100 * 10**6), sessions=1) == (1, 20)
    with caplog.at_level("INFO", logger="ortflow.quantize"):
        assert latency_batches(model_description(eval_bytes_per_sample=10**9), sessions=2) == (1,)  # not batch 1 twice
    assert "latency timed at batch 1 alone, not 64" in caplog.text
    assert latency_batches(model_description(eval_bytes_per_sample=1000), sessions=2) == (1, 64)
    assert latency_batches(model_description(), sessions=2) == (1, 64)  # artifacts from before evaluations were counted
    export = export_metrics({"accuracy": 0.9, "latency_ms": {"b1_p50": 1.0, "b1_p95": 1.0, "b10_p50": 9.0, "b10_p95": 9.0}},
                            {"accuracy": 0.9, "latency_ms": {"b1_p50": 1.0, "b1_p95": 1.0, "b10_p50": 3.0, "b10_p95": 3.0}})
    assert speedup(export) == 3.0
    assert ("speedup", "int8 speed-up (batch 10, 1 thread)", "3.00x") in summary_rows(None, export)


def test_fp32_latency_is_timed_on_the_graph_onnx_runtime_runs_from_the_exported_model(tmp_path, monkeypatch):
    """quantize_model times fp32 as pre-processed for quantization, whose weights' Transposes are
    folded, so that its session does not hold every weight twice beside the int8 session: after
    ONNX Runtime's optimizations, as the latency session loads them, it and the exported model are
    the same nodes and initializers, and compute the same logits bit for bit."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from test_artifacts import build, config

    from ortflow.checkpoints.ort_format import read_ort_checkpoint
    from ortflow.graphs import inference_model
    from ortflow.quantization import measure
    from ortflow.sessions import session_options
    from ortflow.stages import quantize_model
    from ortflow.stages.prepare_data import prepare

    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    model = {"kind": "gpt", "layers": 2, "heads": 2, "width": 32}
    run = config(model, {"source": str(tmp_path / "corpus.txt"), "context": 8})
    prepare(run, tmp_path / "train", tmp_path / "eval")
    info = build(tmp_path / "train", tmp_path / "artifacts", model)
    exported = tmp_path / "model.onnx"
    graph = inference_model.inference_graph(tmp_path / "artifacts" / "eval_model.onnx", info.outputs.logits)
    inference_model.add_weights(graph, read_ort_checkpoint(tmp_path / "artifacts" / "checkpoint").parameters,
                                exported, exported)
    onnx.save(graph, str(exported))
    batch = ShardReader(tmp_path / "eval").gather(np.arange(4))

    def as_run(path: Path, name: str):
        """The graph ONNX Runtime runs (its nodes, attributes by name, and initializers), its logits,
        and how many Transposes of a weight the model itself has."""
        options = session_options(threads=1)
        options.optimized_model_filepath = str(tmp_path / f"{name}.optimized.onnx")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        logits = session.run(None, {value.name: batch[value.name] for value in session.get_inputs()})[0]
        optimized = onnx.load(options.optimized_model_filepath)
        nodes = sorted((node.op_type, node.domain, tuple(node.input), tuple(node.output),
                        tuple(sorted(str(attribute) for attribute in node.attribute))) for node in optimized.graph.node)
        initializers = {tensor.name: numpy_helper.to_array(tensor).tobytes() for tensor in optimized.graph.initializer}
        model = onnx.load(str(path))
        weights = {tensor.name for tensor in model.graph.initializer}
        transposes = sum(node.op_type == "Transpose" and node.input[0] in weights for node in model.graph.node)
        return nodes, initializers, logits, transposes

    timed, latencies = {}, measure.latencies

    def spy(paths, reader, batches):
        timed.update({name: as_run(path, name) for name, path in paths.items()})
        return latencies(paths, reader, batches)

    monkeypatch.setattr(measure, "latencies", spy)
    monkeypatch.setattr(measure, "LATENCY_BUDGET_S", 0.1)  # timing is not what this test is about
    report = quantize_model.quantize(run, exported, tmp_path / "artifacts", tmp_path / "eval",
                                     tmp_path / "model.int8.onnx", tmp_path / "metrics.json",
                                     tmp_path / "generation", tmp_path / "generation-int4")
    nodes, initializers, logits, transposes = as_run(exported, "exported")
    assert transposes == 2 * 4 + 1 and timed["fp32"][3] == 0  # qkv, out, the MLP's two a block, the head: all folded
    assert len(nodes) > 20 and timed["fp32"][0] == nodes
    assert timed["fp32"][1] == initializers
    assert np.array_equal(timed["fp32"][2], logits)
    assert set(timed) == {"fp32", "int8"} and set(report.fp32["latency_ms"]) == {"b1_p50", "b1_p95", "b64_p50",
                                                                                  "b64_p95"}
