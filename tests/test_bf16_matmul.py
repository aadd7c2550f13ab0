"""ortflow.BF16MatMul (src/ortflow/kernels/): compiled at first use, it multiplies float32
tensors in bfloat16 as torch's bf16 matmul does, inside an ONNX Runtime session, and its
errors and its compiler's reach the user in one line. Its speed is measured in
bench/bench_bf16_matmul.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortflow import kernels
from ortflow.errors import PreflightError

# The first call compiles the operator (about 15 s on 2 cores); later ones find it in the cache.
pytestmark = pytest.mark.e2e


def session(op: str = "BF16MatMul", domain: str = "ortflow", inputs: tuple[str, ...] = ("A", "B"),
            **attributes) -> ort.InferenceSession:
    """A session of one `op` node of float32 `inputs` and output Y, with ortflow's operators registered."""
    node = helper.make_node(op, list(inputs), ["Y"], domain=domain, **attributes)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)],
                              ir_version=9)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("a_shape, b_shape, trans_a, trans_b", [
    ((16, 24), (24, 8), 0, 0),
    ((16, 8), (24, 8), 0, 1),  # dX = dY W^T
    ((16, 24), (16, 8), 1, 0),  # dW = X^T dY
    ((2, 3, 16, 24), (24, 8), 0, 0),  # batched, the weight broadcast
])
def test_the_product_is_torchs_bf16_matmul_within_bf16_of_float64(a_shape, b_shape, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape, dtype=np.float32), rng.standard_normal(b_shape, dtype=np.float32)
    y = session(transA=trans_a, transB=trans_b).run(None, {"A": a, "B": b})[0]
    a_, b_ = (a.swapaxes(-1, -2) if trans_a else a), (b.swapaxes(-1, -2) if trans_b else b)
    exact = a_.astype(np.float64) @ b_.astype(np.float64)
    assert y.dtype == np.float32 and y.shape == exact.shape
    assert np.abs(y - exact).max() < 1e-2 * np.abs(exact).max()
    torch_bf16 = torch.matmul(torch.from_numpy(np.ascontiguousarray(a_)).bfloat16(),
                              torch.from_numpy(np.ascontiguousarray(b_)).bfloat16())
    np.testing.assert_array_equal(y, torch_bf16.float().numpy())


def test_atens_error_is_the_sessions_in_one_line():
    with pytest.raises(Exception) as error:
        session().run(None, {"A": np.ones((2, 3), np.float32), "B": np.ones((4, 5), np.float32)})
    assert "ortflow.BF16MatMul: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)" in str(error.value)
    assert "frame #" not in str(error.value)  # no C++ backtrace


def test_a_failed_compile_names_the_compilers_first_error(tmp_path, monkeypatch):
    broken = tmp_path / "operators.cc"
    broken.write_text("int main() { return undeclared_name; }\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kernels.library.cache_clear()
    try:
        with pytest.raises(PreflightError) as error:
            kernels.library()
    finally:
        kernels.library.cache_clear()
    message = str(error.value)
    assert "undeclared_name" in message and "was not declared" in message and "C++17 compiler" in message
    assert "\n" not in message
    assert not list((tmp_path / "cache").rglob("*.so*"))


def test_fast_gelu_grad_is_onnx_runtimes():
    """ortflow.FastGeluGrad (ATen's gelu_backward, tanh) against com.microsoft's, which it replaces in
    bf16 graphs: the same function to float32's rounding."""
    rng = np.random.default_rng(0)
    feeds = {"dY": rng.standard_normal((4, 8, 96), dtype=np.float32),
             "X": rng.standard_normal((4, 8, 96), dtype=np.float32) * 4}
    ours, theirs = (session("FastGeluGrad", domain, ("dY", "X")).run(None, feeds)[0]
                    for domain in ("ortflow", "com.microsoft"))
    assert ours.shape == theirs.shape == (4, 8, 96)
    assert np.abs(ours - theirs).max() <= 4e-6 * np.abs(theirs).max()
    assert np.abs(theirs).max() > 1
    with pytest.raises(Exception, match=r"ortflow.FastGeluGrad: dY and X must have one shape, got \[2, 3\] and \[3\]"):
        session("FastGeluGrad", "ortflow", ("dY", "X")).run(None, {"dY": np.ones((2, 3), np.float32),
                                                                  "X": np.ones(3, np.float32)})
