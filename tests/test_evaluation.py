"""Evaluation's arithmetic: eval results of batch totals summed over batches and ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import model_description
from ortflow.evaluation import batch_totals, eval_results
from ortflow.inference import loss_of


def test_eval_results_of_summed_batch_totals():
    classes = model_description(task="classification", loss="cross_entropy")
    logits = np.array([[2.0, 0.1], [0.2, 1.0], [3.0, -1.0]])
    labels = np.array([0, 1, 1])
    totals = batch_totals(0.5, logits, labels, classes) + batch_totals(1.5, logits[:1], labels[:1], classes)
    assert totals.tolist() == [0.5 * 3 + 1.5 * 1, 2 + 1, 4]
    assert eval_results(totals, "classification") == {"loss": 0.75, "accuracy": 0.75}
    text = model_description(task="language_model", loss="cross_entropy")
    tokens = batch_totals(2.0, np.zeros((2, 5, 3)), np.zeros((2, 3), dtype=np.int64), text)
    assert tokens.tolist() == [12.0, 6.0, 6.0]  # the loss is a mean over the 6 tokens
    assert eval_results(tokens, "language_model") == {"loss": 2.0, "perplexity": math.exp(2.0), "accuracy": 1.0}
    regression = batch_totals(0.25, np.zeros((4, 2)), np.zeros((4, 2)), model_description(task="regression", loss="mse"))
    assert regression.tolist() == [1.0, 0.0, 4.0] and eval_results(regression, "regression") == {"loss": 0.25}


def test_batch_totals_of_one_logit_per_record_and_of_trailing_size_one_dims():
    """bce_with_logits on two classes: one logit per record, class 1 where it is
    positive (argmax over axis 1 failed: the logits have no axis 1). A model-zoo
    classifier's [N, classes, 1, 1] against a flat label: the trailing dims dropped."""
    two_classes = model_description(task="classification", loss="bce_with_logits")
    assert batch_totals(0.5, np.array([2.0, -1.0, 0.5, -3.0]), np.array([1, 0, 0, 0]), two_classes).tolist() == [
        2.0, 3.0, 4.0]
    assert batch_totals(0.5, np.array([[2.0], [-1.0]]), np.array([1, 1]), two_classes).tolist() == [1.0, 1.0, 2.0]
    pooled = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]]).reshape(2, 3, 1, 1)
    classes = model_description(task="classification", loss="cross_entropy")
    assert batch_totals(1.0, pooled, np.array([1, 2]), classes).tolist() == [2.0, 1.0, 2.0]
    expected = loss_of(pooled.reshape(2, 3), np.array([1, 2]), "cross_entropy")
    assert loss_of(pooled, np.array([1, 2]), "cross_entropy") == pytest.approx(expected, rel=1e-12)
