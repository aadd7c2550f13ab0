"""Evaluation's arithmetic: eval results of batch totals summed over batches and ranks."""

from __future__ import annotations

import math

import numpy as np

from ortflow.evaluation import batch_totals, eval_results


def test_eval_results_of_summed_batch_totals():
    logits = np.array([[2.0, 0.1], [0.2, 1.0], [3.0, -1.0]])
    labels = np.array([0, 1, 1])
    totals = batch_totals(0.5, logits, labels, "classification") + batch_totals(1.5, logits[:1], labels[:1],
                                                                                "classification")
    assert totals.tolist() == [0.5 * 3 + 1.5 * 1, 2 + 1, 4]
    assert eval_results(totals, "classification") == {"loss": 0.75, "accuracy": 0.75}
    tokens = batch_totals(2.0, np.zeros((2, 5, 3)), np.zeros((2, 3), dtype=np.int64), "language_model")
    assert tokens.tolist() == [12.0, 6.0, 6.0]  # the loss is a mean over the 6 tokens
    assert eval_results(tokens, "language_model") == {"loss": 2.0, "perplexity": math.exp(2.0), "accuracy": 1.0}
    regression = batch_totals(0.25, np.zeros((4, 2)), np.zeros((4, 2)), "regression")
    assert regression.tolist() == [1.0, 0.0, 4.0] and eval_results(regression, "regression") == {"loss": 0.25}
