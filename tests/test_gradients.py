"""The gradient code that both devices run (ortflow.training.gradients), on numpy:
views of ORT's live buffers, the bucketed in-place all-reduce, averaging, the
global norm and clipping against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ortflow.training import gradients


class Ranks:
    """The all-reduce of `len(others) + 1` ranks as seen from one: this rank's
    gradients plus the other ranks', summed in place."""

    xp = np

    def __init__(self, others: list[list[np.ndarray]]):
        self.others, self.world_size = others, len(others) + 1

    def allreduce_gradients(self, grads):
        for i, g in enumerate(grads):
            g += sum(other[i] for other in self.others)


def rank_gradients(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in [(4, 3), (3,), (2, 2, 5)]]


@pytest.mark.parametrize("clip", [None, 0.5, 1e6])
def test_average_and_clip_equals_the_mean_then_torchs_clip_grad_norm(clip):
    ranks = [rank_gradients(seed) for seed in range(3)]
    accum = 2  # micro-batches per rank: ORT summed them, so the mean divides by ranks x micro-batches
    mine = [g.copy() for g in ranks[0]]
    norm = gradients.average_and_clip(Ranks(ranks[1:]), mine, 1.0 / (accum * 3), clip)

    params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in mine]
    for p, *per_rank in zip(params, *ranks):
        p.grad = torch.from_numpy(sum(per_rank) / (accum * 3))
    total = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
    assert norm == pytest.approx(float(total), rel=1e-6)
    for g, p in zip(mine, params):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-6, atol=1e-7)
    if clip == 0.5:  # it did clip, to the norm asked for
        assert norm > 0.5 and gradients.global_norm(mine, np) == pytest.approx(0.5, rel=1e-5)


def test_average_and_clip_changes_the_buffers_it_is_given():
    grads = rank_gradients(0)
    views = [g.reshape(-1) for g in grads]  # what a caller holds: views, not copies
    gradients.average_and_clip(Ranks([]), views, 0.25, None)
    np.testing.assert_allclose(grads[0], rank_gradients(0)[0] * 0.25)
    assert all(np.shares_memory(v, g) for v, g in zip(views, grads))


def test_allreduce_in_buckets_sums_every_element_in_place_and_reuses_its_buffers(monkeypatch):
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 64)  # 16 float32: tensors share buckets, one goes alone
    grads = [np.arange(n, dtype=np.float32) for n in (3, 40, 7, 1, 5)]
    expected = [g * 3 for g in grads]
    flats = []

    def three_ranks(flat):  # three ranks that hold the same values
        flats.append(flat)
        flat *= 3

    buffers: dict = {}
    gradients.allreduce_in_buckets(grads, np, three_ranks, buffers)
    for g, e in zip(grads, expected):
        np.testing.assert_array_equal(g, e)
    assert [f.size for f in flats] == [3, 40, 13]  # [3], [40] alone, [7, 1, 5] packed
    packing = {k: v for k, v in buffers.items()}
    gradients.allreduce_in_buckets(grads, np, three_ranks, buffers)
    assert all(buffers[k] is packing[k] for k in packing)
    np.testing.assert_array_equal(grads[4], expected[4] * 3)


def test_buckets_cover_every_gradient_once(monkeypatch):
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 1000)
    grads = [np.zeros(n, dtype=np.float32) for n in (10, 60, 5, 100, 400, 1)]
    groups = list(gradients.buckets(grads))
    assert [len(g) for g in groups] == [4, 1, 1]
    assert sum(len(g) for g in groups) == len(grads)
    assert all(sum(x.nbytes for x in g) <= 1000 or len(g) == 1 for g in groups)


def test_global_norm_is_the_norm_of_all_values_together():
    grads = rank_gradients(1)
    assert gradients.global_norm(grads, np) == pytest.approx(
        float(np.linalg.norm(np.concatenate([g.ravel() for g in grads]).astype(np.float64))), rel=1e-6)


@pytest.fixture(scope="module")
def ort_sgd(tmp_path_factory):
    """A one-weight ONNX Runtime training setup (y = x * w, MSE, SGD) after one forward and backward."""
    from onnx import TensorProto, helper
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from ortflow.sessions import quiet_logging

    quiet_logging()
    folder = tmp_path_factory.mktemp("sgd")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])], "mul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    optimizer = Optimizer(str(folder / "optimizer_model.onnx"), module)
    module.train()
    module(np.ones((1, 3), np.float32), np.zeros((1, 3), np.float32))
    return state, optimizer


def test_views_are_ort_s_live_buffers_and_the_optimizer_applies_what_they_hold(ort_sgd):
    """The CPU facts the shared path rests on: OrtValue speaks DLPack, numpy.from_dlpack
    is a zero-copy but read-only view, OrtValue.numpy() a writable one, and an in-place
    change is what Optimizer.step() applies."""
    state, optimizer = ort_sgd
    grad = state._state.get_parameter("w").grad
    assert grad.__dlpack_device__() == (1, 0)  # kDLCPU
    (view,) = gradients.gradients(state, ["w"], np)
    dlpack = np.from_dlpack(grad)
    assert view.flags.writeable and not dlpack.flags.writeable
    assert view.ctypes.data == dlpack.ctypes.data == grad.data_ptr()
    np.testing.assert_allclose(view, [2 / 3, 4 / 3, 2])  # d/dw mean((x w)^2) at x = 1

    gradients.average_and_clip(Ranks([[np.full(3, 1.0, np.float32)]]), [view], 0.5, None)
    np.testing.assert_allclose(dlpack, [5 / 6, 7 / 6, 1.5], rtol=1e-6)  # (g + 1) / 2, seen through DLPack
    before = gradients.parameters_on_host(state, ["w"], np)["w"].copy()
    optimizer.set_learning_rate(1.0)
    optimizer.step()
    after = gradients.parameters_on_host(state, ["w"], np)["w"]
    np.testing.assert_allclose(before - after, [5 / 6, 7 / 6, 1.5], rtol=1e-6)
