"""The export_model and quantize_model stages through the real workflow: the
inference model and its checks, int8 quality, size and latency report, the
quality gate, a user ONNX model. How much faster int8 runs is measured by
bench/bench_quantize.py (docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import run_snakemake
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


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """The default config (digits, MLP [512, 512], dynamic int8) with 150 steps, built to the end once."""
    workdir = tmp_path_factory.mktemp("default")
    run_snakemake(workdir, SHORT)
    return workdir


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


@pytest.fixture(scope="module")
def user_run(tmp_path_factory) -> tuple[Path, dict, object]:
    """A user ONNX model trained through the pipeline, quantized per tensor (the default): the gate fails."""
    workdir = tmp_path_factory.mktemp("user")
    workdir.mkdir(exist_ok=True)
    write_user_model(workdir / "user_mlp.onnx")
    config = {"run": {"name": "user"}, "model": {"kind": "onnx", "path": "user_mlp.onnx"}, **SHORT}
    result = run_snakemake(workdir, config, check=False)
    return workdir, config, result


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
    assert props == {"ortflow.run": "digits", "ortflow.step": "150", "ortflow.version": "0.1.0",
                     "ortflow.identity_digest": meta["identity_digest"]}
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


def test_int8_keeps_accuracy_and_is_3x_smaller(default_run):
    metrics = _metrics(default_run)
    fp32, int8 = metrics["fp32"], metrics["int8"]
    assert metrics["quantize"] == "dynamic" and metrics["threads"] == 1
    trained = json.loads((default_run / "results/digits/train/metrics.json").read_text())["eval"]
    assert fp32["accuracy"] == pytest.approx(trained["accuracy"]) and fp32["loss"] == pytest.approx(trained["loss"])
    assert fp32["accuracy"] >= 0.93, fp32
    assert fp32["accuracy"] - int8["accuracy"] <= 0.01, (fp32, int8)
    assert int8["size_bytes"] == (_export(default_run) / "model.int8.onnx").stat().st_size
    assert fp32["size_bytes"] >= 3 * int8["size_bytes"], (fp32["size_bytes"], int8["size_bytes"])
    for entry in (fp32, int8):
        latency = entry["latency_ms"]
        assert sorted(latency) == ["b1_p50", "b1_p95", "b64_p50", "b64_p95"]
        assert 0 < latency["b1_p50"] <= latency["b1_p95"] and 0 < latency["b64_p50"] <= latency["b64_p95"]
    assert metrics["gate"] == {"metric": "accuracy", "drop": pytest.approx((fp32["accuracy"] - int8["accuracy"]) * 100),
                               "unit": "points", "max_accuracy_drop": 1.0}
    log = _log(default_run, "quantize_model")
    assert re.search(r"accuracy \(%\)\s+[\d.]+\s+[\d.]+\s+[+-]", log), log
    assert "x smaller" in log and "x faster" in log and "quality gate passed" in log


def test_quantize_none_reports_fp32_only(default_run, tmp_path):
    workdir = tmp_path / "none"
    shutil.copytree(default_run, workdir, symlinks=True)
    result = run_snakemake(workdir, {**SHORT, "export": {"quantize": "none"}})
    assert "quantize_model" in _rules_run(result)
    metrics = _metrics(workdir)
    assert "int8" not in metrics and metrics["fp32"]["accuracy"] == _metrics(default_run)["fp32"]["accuracy"]
    assert not (_export(workdir) / "model.int8.onnx").exists()


def test_gate_fails_with_both_numbers_and_keeps_the_fp32_model(user_run):
    workdir, _, result = user_run
    assert result.returncode != 0
    log = _log(workdir, "quantize_model", "user")
    match = re.search(r"quality gate: int8 accuracy ([\d.]+) against fp32 ([\d.]+) is a loss of ([\d.]+) points, "
                      r"more than export.max_accuracy_drop=1.0", log)
    assert match, log[-3000:]
    int8, fp32, drop = map(float, match.groups())
    assert fp32 >= 90 and drop == pytest.approx(fp32 - int8, abs=0.01) and drop > 1.0
    assert (_export(workdir, "user") / "model.onnx").is_file()
    assert not (_export(workdir, "user") / "model.int8.onnx").exists()
    assert not (_export(workdir, "user") / "metrics.json").exists()


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
