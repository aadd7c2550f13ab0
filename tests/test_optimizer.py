"""The optimizer that ortflow runs over arrays it holds (training/optimizer.py):
ORT's own optimizer graph in an InferenceSession, over views of ORT's live
buffers and moments of its own, against the training API's Optimizer, which
keeps the moments inside the CheckpointState; and its refusal of a binding that
would copy the parameters instead of updating them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ortflow.artifacts import Artifacts
from ortflow.checkpoints.ort_format import training_state
from ortflow.errors import TrainingError
from ortflow.sessions import session_options
from ortflow.training import engine, gradients
from ortflow.training.optimizer import GraphStep, Optimizer, Piece, views
from ortflow.training.weight_decay import WeightDecay
import test_weight_decay as tiny_gpt
from test_weight_decay import settings

built, train_dir = tiny_gpt.built, tiny_gpt.train_dir  # the fixtures of the tiny GPT's data and artifacts


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_ort_s_graph_over_held_arrays_is_bit_for_bit_the_training_api_s_optimizer(built, kind):
    from onnxruntime.training.api import Module, Optimizer as OrtOptimizer

    artifacts = Artifacts(built[kind][0])
    theirs = engine.initial_state(artifacts)
    module = Module(str(artifacts.training_model), theirs, str(artifacts.eval_model))
    ort_optimizer = OrtOptimizer(str(artifacts.optimizer_model), module)
    ours = engine.initial_state(artifacts)
    our_module, step = engine.open_sessions(artifacts, ours, "cpu", 1, settings(kind).train.optimizer, np)
    names = engine.trainable(ours)
    # Whole tensors for some parameters, two slices of one for the others: a slice steps as the whole does,
    # bit for bit where it is cut at 16 elements (64 bytes). ONNX Runtime's kernel steps a tensor's body in
    # vector packets and the elements after it one by one, and the two can round one unit in the last place
    # apart: a slice cut elsewhere has ends that step alone where the whole tensor's were in a packet
    # (element 0 of an 8-element bias, cut after 2, differed by 7.5e-9 on some gradients).
    pieces = [Piece(n, 0, p.size) for n, p in zip(names, gradients.parameters(ours, names, np))]
    cut = next(piece for piece in pieces if piece.stop >= 48)
    pieces.remove(cut)
    pieces += [Piece(cut.name, 0, 16), Piece(cut.name, 16, cut.stop)]
    no_decay = WeightDecay({}, [], replace(settings(kind).train.optimizer, weight_decay=0.0))
    halves = [Optimizer(ours, pieces[:-1], settings(kind).train.optimizer, np),
              Optimizer(ours, pieces[-1:], settings(kind).train.optimizer, np)]
    rng = np.random.default_rng(0)
    module.train(), our_module.train()
    for number in range(4):
        x = rng.integers(0, 20, (4, 8)).astype(np.int64)
        lr = 0.01 * (number + 1)
        module(x, x), our_module(x, x)
        ort_optimizer.set_learning_rate(lr)
        ort_optimizer.step()
        for optimizer in halves:
            optimizer.step(lr, step, no_decay)
        module.lazy_reset_grad(), our_module.lazy_reset_grad()
        for name, a, b in zip(names, gradients.parameters(theirs, names, np), gradients.parameters(ours, names, np)):
            np.testing.assert_array_equal(a, b, f"{kind} step {number + 1}: {name}")
    reference = training_state(theirs)
    assert reference.optimizer["step"] == halves[0].count == 4
    for optimizer in halves:
        for piece in optimizer.pieces:
            for moment, array in optimizer.moments_of(piece.name, piece.start, piece.stop).items():
                expected = reference.optimizer_states[piece.name][moment].reshape(-1)[piece.start:piece.stop]
                np.testing.assert_array_equal(array, expected, f"{kind} {moment} of {piece}")
    assert all(v.flags.c_contiguous for v in views(ours, pieces, "data", np))


def test_a_step_that_does_not_update_in_place_is_refused(built, monkeypatch):
    class Copying(GraphStep):
        """What a binding that copies its inputs would do: the update lands in a copy."""

        def __call__(self, lr, step, params, grads, moments):
            super().__call__(lr, step, [p.copy() for p in params], grads, moments)

    monkeypatch.setattr(GraphStep, "checked", False)
    with pytest.raises(TrainingError) as error:
        Copying(Artifacts(built["adamw"][0]).optimizer_model, session_options(1), np)
    assert str(error.value).endswith("did not update the parameters given to its optimizer graph in place (ortflow "
                                     "steps ORT's live buffers through it): install the onnxruntime-training "
                                     "version pyproject.toml pins")
