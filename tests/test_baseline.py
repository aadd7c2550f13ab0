"""The baseline a model must beat (src/ortflow/data/baseline.py): scored from the train split's
labels on the eval split, kept beside the measures training can compare, and the words when it is not beaten."""

import json

import numpy as np
import pytest

from ortflow.data import baseline


def test_a_classifier_is_measured_against_the_train_splits_most_frequent_class():
    label = np.array([0, 1, 1, 1, 2, 1, 0, 2, 2, 0])
    train, eval_rows = np.arange(6), np.arange(6, 10)  # train: class 1 four times of six
    scored = baseline.of_split(label, "classification", 3, train, eval_rows)
    assert scored == baseline.Baseline("the train split's most frequent class (1)", accuracy=0.0)


def test_a_regression_is_measured_against_the_train_splits_mean():
    label = np.array([1.0, 3.0, 2.0, 4.0, 6.0], dtype=np.float32)
    scored = baseline.of_split(label, "regression", None, np.arange(2), np.arange(2, 5))  # train mean 2
    # eval 2, 4, 6: squared errors 0, 4, 16 -> 20/3; their variance around 4: 8/3
    assert scored.mse == pytest.approx(20 / 3) and scored.r2 == pytest.approx(1 - (20 / 3) / (8 / 3))


def test_a_language_models_unigram_perplexity_is_read_in_blocks(monkeypatch):
    tokens = np.random.default_rng(0).integers(0, 5, (300, 4))
    train, eval_rows = np.arange(200), np.arange(200, 300)
    whole = baseline.of_split(tokens, "language_model", 5, train, eval_rows).perplexity
    monkeypatch.setattr(baseline, "BLOCK", 7)
    assert baseline.of_split(tokens, "language_model", 5, train, eval_rows).perplexity == pytest.approx(whole)
    counts = np.bincount(tokens[train].reshape(-1), minlength=5) + 1.0
    expected = np.exp(-np.log(counts / counts.sum())[tokens[eval_rows].reshape(-1)].mean())
    assert whole == pytest.approx(expected)


def test_training_compares_a_regressions_mse_with_its_loss_only_for_the_mse_loss(tmp_path):
    baseline.write(tmp_path, baseline.Baseline("the train split's mean", mse=2.5, r2=-0.1))
    assert baseline.for_training(tmp_path, "mse") == {"of": "the train split's mean", "loss": 2.5, "r2": -0.1}
    assert baseline.for_training(tmp_path, "l1") is None
    assert json.loads((tmp_path / baseline.BASELINE).read_text())["mse"] == 2.5
    assert baseline.for_training(tmp_path / "older", "mse") is None  # data prepared before baselines


@pytest.mark.parametrize("results, said", [
    ({"accuracy": 0.5}, "eval accuracy 0.5 is not above 0.6, that of predicting the train split's most frequent class"),
    ({"accuracy": 0.6 * (1 + 1e-7)}, "eval accuracy"),  # within rounding: not beaten
    ({"accuracy": 0.61}, None),
])
def test_a_model_that_does_not_beat_its_baseline_is_named(results, said):
    measures = {"of": "the train split's most frequent class (1)", "accuracy": 0.6}
    shown = baseline.not_beaten(results, measures)
    assert (shown is None) if said is None else (said in shown)
    assert baseline.not_beaten({"loss": 3.0}, {"of": "the train split's mean", "loss": 2.5, "r2": 0.0}).endswith(
        "eval loss 3 is not below 2.5, that of predicting the train split's mean")
    assert baseline.not_beaten(results, None) is None
