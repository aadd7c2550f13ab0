"""Tabular data as users have it: scikit-learn's own data sets (shipped inside
its package) written to CSV unscaled. `data.standardize` (the train split's
statistics in the manifest and the shards, baked into the exported model) and
the predict-the-mean baseline of a regression run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import run_snakemake
from ortflow import config as ortflow_config
from ortflow.data import standardize
from ortflow.stages.prepare_data import split_rows
from ortflow.data.shards import ShardReader
from ortflow.export.checks import TOLERANCE
from ortflow.inference import loss_of
from ortflow.quantization import gate
from ortflow.reporting.results import fmt, read_train
from ortflow.reporting.tables import summary_rows

SEED = 1234  # run.seed of config/config.yaml


def write_csv(workdir: Path, bunch) -> tuple[pd.DataFrame, list[str]]:
    """A scikit-learn data set as a CSV file `<workdir>/data.csv`, as it comes (no scaling); label column `target`."""
    workdir.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(bunch.data, columns=[f"f{i}" for i in range(bunch.data.shape[1])])
    frame["target"] = bunch.target
    frame.to_csv(workdir / "data.csv", index=False)
    return frame, list(frame.columns[:-1])


def test_statistics_skip_integer_inputs_and_let_constant_columns_pass():
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.normal(500, 40, 50), np.full(50, 7.0)]).astype(np.float32)
    ids = rng.integers(0, 100, (50, 4))
    rows = np.arange(0, 50, 2)
    stats = standardize.statistics({"x": x, "ids": ids}, rows)
    assert list(stats) == ["x"]  # token ids are never standardized
    assert np.allclose(stats["x"]["mean"], x[rows].astype(np.float64).mean(axis=0), rtol=1e-12, atol=0)
    assert stats["x"]["std"] == [x[rows, 0].astype(np.float64).std(), 1.0]  # the constant column: std 0 -> 1
    scaled = standardize.apply({"x": x, "ids": ids}, stats)
    assert scaled["ids"] is ids
    assert np.all(scaled["x"][:, 1] == 0)
    assert abs(scaled["x"][rows, 0].mean()) < 1e-5 and abs(scaled["x"][rows, 0].std() - 1) < 1e-5
    assert np.allclose(standardize.invert(scaled, stats)["x"], x, rtol=1e-6)


@pytest.mark.e2e
def test_wine_standardized_trains_and_the_export_takes_raw_features(workdir):
    """178 wines, 13 unscaled features (proline up to 1680), 3 classes: through to the quantized model."""
    import onnx
    import onnxruntime as ort
    from sklearn.datasets import load_wine

    frame, features = write_csv(workdir, load_wine())
    config = {"run": {"name": "wine"}, "data": {"source": "data.csv", "features": features, "label": "target",
                                                 "standardize": True},
              "train": {"steps": 100, "eval_every": 50, "checkpoint_every": 50}}
    run_snakemake(workdir, config, "quantize_model")
    results = workdir / "results" / "wine"

    # The manifest's statistics are numpy's over the train split only, in float64.
    raw = frame[features].to_numpy(np.float32)
    train_rows, eval_rows = split_rows(len(frame), 0.2, SEED)
    expected_mean = raw[train_rows].astype(np.float64).mean(axis=0)
    expected_std = raw[train_rows].astype(np.float64).std(axis=0)
    for split in ("train", "eval"):
        stats = ShardReader(results / "data" / split).manifest.standardize
        assert np.allclose(stats["x"]["mean"], expected_mean, rtol=1e-12, atol=0)
        assert np.allclose(stats["x"]["std"], expected_std, rtol=1e-12, atol=0)
    # The shards hold the standardized features, the exported model takes the raw ones.
    eval_reader = ShardReader(results / "data" / "eval")
    mean, std = expected_mean.astype(np.float32), expected_std.astype(np.float32)
    assert np.array_equal(eval_reader.gather(np.arange(len(eval_rows)))["x"], (raw[eval_rows] - mean) / std)

    train = json.loads((results / "train" / "metrics.json").read_text())
    labels = frame["target"].to_numpy()[eval_rows]
    for name in ("model.onnx", "model.int8.onnx"):
        path = results / "export" / name
        first = onnx.load(str(path)).graph.node[:2]
        assert [(n.op_type, n.input[0]) for n in first] == [("Sub", "x"), ("Div", first[0].output[0])], name
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        logits = session.run(None, {"x": raw[eval_rows]})[0]
        accuracy = float((logits.argmax(axis=1) == labels).mean())
        assert accuracy > 0.8, (name, accuracy)  # chance: 40% (the largest class); measured 91.7%
        if name == "model.onnx":
            # The exported model on the raw CSV rows is the eval graph on the standardized shards.
            assert accuracy == train["eval"]["accuracy"]
            loss = loss_of(logits, labels, "cross_entropy")
            assert abs(loss - train["eval"]["loss"]) <= TOLERANCE["relative"] * train["eval"]["loss"] + 1e-6
    assert "logits within" in (workdir / "logs" / "wine" / "export_model.log").read_text()

    # With data.standardize set, the int8 gate no longer suggests it (the suggestions' wording, and the
    # unscaled features' suggestion, are in test_the_int8_gate_suggests_standardize_...).
    export_cfg = ortflow_config.typed(ortflow_config.validate({"export": {"quantize": "static"}})).export
    assert gate.remedies(export_cfg, "static", ShardReader(results / "data" / "eval", raw=True)) == [
        "export.per_channel: true", "a larger export.max_accuracy_drop", "or export.quantize: none"]


@pytest.mark.e2e
def test_regression_reports_the_predict_the_mean_baseline(workdir):
    """442 diabetes patients, 10 unscaled features, a float target (25..346): trained with the mse loss."""
    from sklearn.datasets import load_diabetes

    frame, features = write_csv(workdir, load_diabetes(scaled=False))
    config = {"run": {"name": "diabetes"}, "data": {"source": "data.csv", "features": features, "label": "target",
                                                     "standardize": True},
              "model": {"hidden": [64]},
              "train": {"steps": 200, "eval_every": 100, "checkpoint_every": 100,
                        "optimizer": {"name": "adamw", "lr": 0.05, "weight_decay": 0.0}}}
    result = run_snakemake(workdir, config, "train")
    metrics = workdir / "results" / "diabetes" / "train" / "metrics.json"
    train = json.loads(metrics.read_text())

    target = frame["target"].to_numpy(np.float32).astype(np.float64)  # labels are stored as float32
    train_rows, eval_rows = split_rows(len(frame), 0.2, SEED)
    expected = float(((target[eval_rows] - target[train_rows].mean()) ** 2).mean())
    baseline = train["baseline"]["loss"]
    assert abs(baseline - expected) <= 1e-9 * expected, (baseline, expected)
    variance = float(target[eval_rows].var())
    assert train["baseline"]["r2"] == pytest.approx(1 - expected / variance, rel=1e-9)
    # The model clears the bar: its eval MSE is well below predicting the mean.
    assert train["eval"]["loss"] < 0.75 * baseline, train["eval"]
    shown = (f"mse {fmt(baseline, 'float')}, R^2 {fmt(train['baseline']['r2'], 'float')} "
             "(predicting the train split's mean)")
    assert f"  baseline  {shown}" in result.stdout
    assert f"  loss      {fmt(train['eval']['loss'], 'float')}" in result.stdout
    assert "does not beat the baseline" not in result.stdout
    assert ("baseline", "baseline (eval split)", shown) in summary_rows(read_train(metrics), None)


@pytest.mark.e2e
def test_a_regressor_that_cannot_beat_the_mean_is_told_so(workdir):
    """A feature that is 0 in every row cannot predict a target of +1 and -1 whose mean is 0 on both
    splits: the model predicts one value c for every record, whose eval MSE 1 + c^2 is never below the
    baseline's 1 (predicting the train split's mean, 0)."""
    n = 200
    train_rows, eval_rows = split_rows(n, 0.2, SEED)
    target = np.zeros(n)
    for rows in (train_rows, eval_rows):  # each split: as many +1 as -1
        target[rows] = np.resize([1.0, -1.0], len(rows))
    workdir.mkdir(parents=True)
    pd.DataFrame({"zero": np.zeros(n), "target": target}).to_csv(workdir / "data.csv", index=False)
    config = {"run": {"name": "unpredictable"}, "data": {"source": "data.csv", "features": ["zero"], "label": "target"},
              "model": {"hidden": [8]}, "train": {"steps": 30, "world_size": 1, "eval_every": 10}}
    result = run_snakemake(workdir, config, "train")
    metrics = workdir / "results" / "unpredictable" / "train" / "metrics.json"
    train = json.loads(metrics.read_text())
    assert train["baseline"] == {"of": "the train split's mean", "loss": 1.0, "r2": 0.0}
    assert train["eval"]["loss"] >= 1.0 - 1e-6, train["eval"]
    said = (f"  warning   the model does not beat the baseline: eval loss {train['eval']['loss']:.6g} is not below 1, "
            "that of predicting the train split's mean")
    assert said in result.stdout
    assert "  baseline  mse 1.0000, R^2 0.0000 (predicting the train split's mean)" in result.stdout
    assert ("beats_baseline", "beats the baseline", "no") in summary_rows(read_train(metrics), None)
    assert "on 1 rank\n" in result.stdout  # one rank, not "1 ranks"


@pytest.mark.e2e
def test_bce_with_logits_on_a_two_class_label_evaluates_and_exports(workdir):
    """569 tumours, 30 unscaled features, a 0/1 label, with model.loss bce_with_logits (one logit per
    record, as README documents for two classes): the first evaluation crashed every rank (`axis 1 is out
    of bounds for array of dimension 1`). A record is predicted class 1 where its logit is positive."""
    import onnxruntime as ort
    from sklearn.datasets import load_breast_cancer

    frame, features = write_csv(workdir, load_breast_cancer())
    config = {"run": {"name": "cancer"}, "data": {"source": "data.csv", "features": features, "label": "target",
                                                   "standardize": True},
              "model": {"loss": "bce_with_logits"},
              "train": {"steps": 30, "eval_every": 10, "checkpoint_every": 30}}
    run_snakemake(workdir, config, "quantize_model")
    results = workdir / "results" / "cancer"
    train = json.loads((results / "train" / "metrics.json").read_text())
    assert [entry["step"] for entry in train["history"]["eval"]] == [10, 20, 30]
    assert train["eval"]["accuracy"] > 0.9, train["eval"]  # chance: 63% (the larger class)

    raw = frame[features].to_numpy(np.float32)
    _, eval_rows = split_rows(len(frame), 0.2, SEED)
    labels = frame["target"].to_numpy()[eval_rows]
    session = ort.InferenceSession(str(results / "export" / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"x": raw[eval_rows]})[0]
    assert logits.shape == (len(eval_rows),)
    assert float(((logits > 0) == labels).mean()) == train["eval"]["accuracy"]
    loss = loss_of(logits, labels, "bce_with_logits")
    assert abs(loss - train["eval"]["loss"]) <= TOLERANCE["relative"] * train["eval"]["loss"] + 1e-6
    quantized = json.loads((results / "export" / "metrics.json").read_text())
    assert quantized["fp32"]["accuracy"] == train["eval"]["accuracy"] and "accuracy" in quantized["int8"]


def test_unscaled_features_are_told_apart_from_scaled_ones():
    from sklearn.datasets import load_digits, load_wine

    wine = load_wine().data.astype(np.float32)
    columns = [f"f{i}" for i in range(13)]
    problem = standardize.unscaled([{"x": wine[:100]}, {"x": wine[100:]}], columns)
    peaks = np.abs(wine).max(axis=0)
    assert problem == (f"the features are unscaled: column f12 reaches {peaks[12]:.4g} and column "
                       f"f{peaks.argmin()} at most {peaks.min():.4g}, {peaks[12] / peaks.min():.0f}x apart")
    # Pixels of 0..16 (some never lit) are on one scale; so are standardized features.
    assert standardize.unscaled([{"x": load_digits().data.astype(np.float32)}], ["x"]) is None
    stats = standardize.statistics({"x": wine}, np.arange(len(wine)))
    assert standardize.unscaled([standardize.apply({"x": wine}, stats)], columns) is None


@pytest.mark.e2e
def test_the_int8_gate_suggests_standardize_for_unscaled_features_and_only_settings_not_set(workdir):
    """Wine unscaled, quantized statically, with a gate that refuses every int8 model (so that the
    outcome does not depend on where int8 lands on this CPU): the message suggests data.standardize
    but not export.quantize: static (already set). That with data.standardize set it no longer does is
    asserted on the standardized wine run (test_wine_standardized_...)."""
    from sklearn.datasets import load_wine

    frame, features = write_csv(workdir, load_wine())
    config = {"run": {"name": "wine"}, "data": {"source": "data.csv", "features": features, "label": "target"},
              "train": {"steps": 100, "eval_every": 100, "checkpoint_every": 100},
              "export": {"quantize": "static", "max_accuracy_drop": -1000.0}}
    log = workdir / "logs" / "wine" / "quantize_model.log"
    run_snakemake(workdir, config, "quantize_model")
    refusal = next(line for line in log.read_text().splitlines() if "quality gate: int8 accuracy" in line)
    _, eval_rows = split_rows(len(frame), 0.2, SEED)
    peaks = np.abs(frame[features].to_numpy(np.float32)[eval_rows]).max(axis=0)
    low = int(peaks.argmin())
    assert refusal.endswith(
        f"(try data.standardize: true (the features are unscaled: column f12 reaches {peaks[12]:.4g} and column "
        f"f{low} at most {peaks[low]:.4g}, {peaks[12] / peaks[low]:.0f}x apart); export.per_channel: true; "
        "a larger export.max_accuracy_drop; or export.quantize: none)"), refusal
    assert "export.quantize: static" not in refusal
    quantized = json.loads((workdir / "results" / "wine" / "export" / "metrics.json").read_text())
    assert quantized["quantize"] == "static" and quantized["gate"]["outcome"] == "refused", quantized["gate"]
