"""graphs/gelu_grad.py: com.microsoft's FastGeluGrad as ONNX's element-wise operators in float32
training graphs, against ONNX Runtime's kernel and torch's autograd of the same GELU."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from ortflow.graphs import gelu_grad

F = TensorProto.FLOAT


def model_of(nodes: list, inputs: list[str], outputs: list[str]):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name, F, ["n"]) for name in inputs],
                              [helper.make_tensor_value_info(name, F, ["n"]) for name in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def run(model, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_the_nodes_compute_fast_gelu_grad_as_onnx_runtime_and_autograd_do():
    nodes = [helper.make_node("FastGeluGrad", ["dy", "x"], ["dx"], name="mlp/FastGeluGrad", domain="com.microsoft")]
    kernel, decomposed = model_of(nodes, ["dy", "x"], ["dx"]), model_of(nodes, ["dy", "x"], ["dx"])
    assert gelu_grad.decompose(decomposed) == 1
    onnx.checker.check_model(decomposed, full_check=True)
    assert "FastGeluGrad" not in [node.op_type for node in decomposed.graph.node]
    assert {node.op_type for node in decomposed.graph.node} == {"Constant", "Mul", "Add", "Sub", "Tanh"}

    rng = np.random.default_rng(0)
    # Wide enough for tanh to saturate at both ends (|u| > 9 from |x| > 5).
    x = np.concatenate([rng.standard_normal(4096) * 3, np.linspace(-12, 12, 97)]).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    ours = run(decomposed, {"dy": dy, "x": x})[0]
    theirs = run(kernel, {"dy": dy, "x": x})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())

    x_torch = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    torch.nn.functional.gelu(x_torch, approximate="tanh").backward(torch.from_numpy(dy.astype(np.float64)))
    np.testing.assert_allclose(ours, x_torch.grad.numpy(), rtol=1e-5, atol=1e-5 * np.abs(ours).max())


def test_a_graph_without_fast_gelu_grad_is_told_without_parsing_it(tmp_path):
    nodes = [helper.make_node("FastGeluGrad", ["dy", "x"], ["dx"], domain="com.microsoft")]
    onnx.save(model_of(nodes, ["dy", "x"], ["dx"]), tmp_path / "with.onnx")
    onnx.save(model_of([helper.make_node("Mul", ["dy", "x"], ["dx"])], ["dy", "x"], ["dx"]), tmp_path / "without.onnx")
    assert gelu_grad.mentioned(tmp_path / "with.onnx") and not gelu_grad.mentioned(tmp_path / "without.onnx")


def test_each_fast_gelu_grad_is_replaced_in_place_with_one_set_of_constants():
    nodes = [
        helper.make_node("FastGeluGrad", ["dy", "x"], ["g1"], name="h.0/FastGeluGrad", domain="com.microsoft"),
        helper.make_node("Relu", ["g1"], ["r"], name="between"),
        helper.make_node("FastGeluGrad", ["r", "x"], ["g2"], name="h.1/FastGeluGrad", domain="com.microsoft"),
    ]
    model = model_of(nodes, ["dy", "x"], ["g2"])
    assert gelu_grad.decompose(model) == 2
    names = [node.name for node in model.graph.node]
    # The constants once, first; each node's steps where it stood, under its name; the rest untouched.
    assert names[:5] == [f"ortflow.gelu_grad.{name}" for name in ("k", "ka", "three", "one", "half")]
    steps = len(gelu_grad.steps("dy", "x", "dx"))
    assert names[5:] == ([f"h.0/FastGeluGrad/{node.op_type}_{i}" for i, node in enumerate(model.graph.node[5:5 + steps])]
                         + ["between"]
                         + [f"h.1/FastGeluGrad/{node.op_type}_{i}" for i, node in enumerate(model.graph.node[6 + steps:])])
    onnx.checker.check_model(model, full_check=True)
    x, dy = np.linspace(-3, 3, 12, dtype=np.float32), np.ones(12, np.float32)
    g1 = run(model_of(nodes[:1], ["dy", "x"], ["g1"]), {"dy": dy, "x": x})[0]
    expected = run(model_of(nodes[2:], ["r", "x"], ["g2"]), {"r": np.maximum(g1, 0), "x": x})[0]
    np.testing.assert_allclose(run(model, {"dy": dy, "x": x})[0], expected, rtol=1e-5, atol=1e-6)
    assert gelu_grad.decompose(model) == 0  # nothing left to replace, nothing added
    assert len(model.graph.node) == 5 + 2 * steps + 1
