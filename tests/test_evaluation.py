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


def test_a_language_models_eval_is_over_the_tokens_in_the_loss():
    """Chats and prompt-completion pairs label their prompts and padding IGNORE_INDEX (issue 42): each
    batch's loss is the mean over its tokens in the loss, and the eval loss, perplexity and accuracy
    weigh each batch by those tokens, not by its positions."""
    text = model_description(task="language_model", loss="cross_entropy")
    x = -100
    logits = np.zeros((2, 3, 4))  # [batch, vocab, time]
    logits[:, 1, :] = 2.0  # token 1 the most likely everywhere
    labels = np.array([[x, x, 1, 2], [x, 1, 1, x]])  # 4 tokens in the loss of 8 positions
    kept = labels != x
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    picked = np.take_along_axis(probabilities, np.where(kept, labels, 0)[:, None], axis=1)[:, 0]
    mean = float(-np.log(picked[kept]).mean())  # 3 tokens at p(1), one at p(2)
    assert loss_of(logits, labels, "cross_entropy") == pytest.approx(mean, rel=1e-12)
    assert mean != pytest.approx(float(-np.log(np.where(kept, picked, probabilities[:, 0])).mean()), rel=1e-3)
    first = batch_totals(mean, logits, labels, text)
    assert first.tolist() == pytest.approx([4 * mean, 3, 4])
    # a second batch of one token in the loss: the eval mean is over the 5 tokens, not the 12 positions
    other = batch_totals(0.5, logits[:1], np.array([[x, x, x, 0]]), text)
    assert other.tolist() == [0.5, 0.0, 1.0]
    results = eval_results(first + other, "language_model")
    assert results["loss"] == pytest.approx((4 * mean + 0.5) / 5, rel=1e-12)
    assert results["perplexity"] == pytest.approx(math.exp((4 * mean + 0.5) / 5), rel=1e-12)
    assert results["accuracy"] == 3 / 5
