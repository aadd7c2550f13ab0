"""What a model must beat on the eval split, from the labels alone: the train
split's most frequent class (classification), its mean (regression), its token
frequencies (a language model), each scored on the eval split.

prepare_data computes it where the split is made and writes it beside the eval
shards (BASELINE); training copies the measures it can compare with its own
evaluation into metrics.json (`baseline`), which the summary, the report and a
sweep's comparison read. baseline.json is a record (records.py), read in one place.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from .. import records
from ..models import IGNORE_INDEX
from .shards import drop_mapped_pages
from ..errors import DataError

BASELINE = "baseline.json"
REMEDY = "run the prepare_data rule again"
# Labels read at a time (8 MB of int64): a language model's labels are windows over a token stream that may
# not fit in memory, and a block's copies were the peak RSS of prepare_data on documents (docs/benchmarks.md).
BLOCK = 1 << 20
# Which way each measure is better.
HIGHER_IS_BETTER = {"accuracy": True, "loss": False, "perplexity": False}
# A model within this (relative) of the baseline has not beaten it: the eval measures are sums
# of float32 values, so that a model which predicts the baseline itself can land a rounding below it.
ROUNDING = 1e-6


@dataclasses.dataclass(frozen=True)
class Baseline:
    """baseline.json: what is predicted (`of`) and its measures on the eval split, those of its task."""

    of: str
    accuracy: float | None = None  # a classifier's (null: no eval label counts)
    mse: float | None = None  # a regression's
    r2: float | None = None  # a regression's (null: the eval labels do not vary)
    perplexity: float | None = None  # a language model's

    def measures(self) -> dict:
        """The file's JSON: `of` and its task's measures, the others left out."""
        task = next((names for names in (("mse", "r2"), ("perplexity",)) if getattr(self, names[0]) is not None),
                    ("accuracy",))  # a classifier's accuracy may be null
        return {"of": self.of, **{name: getattr(self, name) for name in task}}


def of_split(label: np.ndarray, task: str, num_classes: int | None, train_rows: np.ndarray,
             eval_rows: np.ndarray) -> Baseline:
    """The baseline of `task`: its name (`of`) and its measures on the eval split."""
    if task == "classification":  # over the labels that are not IGNORE_INDEX
        train = label[train_rows]
        counts = np.bincount(train[train != IGNORE_INDEX], minlength=num_classes)
        majority = int(counts.argmax())
        truth = label[eval_rows]
        truth = truth[truth != IGNORE_INDEX]
        return Baseline(f"the train split's most frequent class ({majority})",
                        accuracy=float((truth == majority).mean()) if truth.size else None)
    if task == "regression":
        mean = label[train_rows].astype(np.float64).mean(axis=0)
        truth = label[eval_rows].astype(np.float64)
        mse = float(((truth - mean) ** 2).mean())
        variance = float(((truth - truth.mean(axis=0)) ** 2).mean())
        return Baseline("the train split's mean", mse=mse, r2=1 - mse / variance if variance else None)
    return Baseline("the train split's token frequencies",
                    perplexity=unigram_perplexity(label, train_rows, eval_rows, num_classes))


def unigram_perplexity(label: np.ndarray, train_rows: np.ndarray, eval_rows: np.ndarray, vocab_size: int) -> float:
    """The perplexity on the eval tokens of a model that knows only how often each
    token occurs in the train split, add-one smoothed (a token it never saw counts once)."""
    counts = np.ones(vocab_size)
    for rows in blocks(train_rows, int(np.prod(label.shape[1:]))):
        chosen = label[rows].reshape(-1)
        counts += np.bincount(chosen[chosen != IGNORE_INDEX], minlength=vocab_size)
        drop_mapped_pages(label)
    log_p = np.log(counts / counts.sum())
    total, tokens = 0.0, 0
    for rows in blocks(eval_rows, int(np.prod(label.shape[1:]))):
        chosen = label[rows].reshape(-1)
        chosen = chosen[chosen != IGNORE_INDEX]  # a target's padding (sequence-to-sequence)
        total, tokens = total + float(log_p[chosen].sum()), tokens + len(chosen)
        drop_mapped_pages(label)
    return float(np.exp(-total / tokens))


def blocks(rows: np.ndarray, labels_a_row: int) -> list[np.ndarray]:
    per_block = max(1, BLOCK // labels_a_row)
    return np.array_split(rows, max(1, -(-len(rows) // per_block)))


def write(eval_dir: Path, baseline: Baseline) -> None:
    records.write_data(Path(eval_dir) / BASELINE, baseline.measures())


def read(eval_dir: Path) -> Baseline | None:
    """baseline.json of the eval split in `eval_dir`, every field checked; None for data prepared
    before baselines were recorded."""
    path = Path(eval_dir) / BASELINE
    return records.read(Baseline, path, DataError, REMEDY) if path.is_file() else None


def for_training(eval_dir: Path, loss: str) -> dict | None:
    """The baseline beside a run's own eval measures (the keys of its evaluation), as train/metrics.json
    keeps it: a regression's MSE is comparable to the eval loss only when the loss is mse.
    None for data prepared before baselines were recorded."""
    baseline = read(eval_dir)
    if baseline is None:
        return None
    measures = baseline.measures()
    if baseline.mse is not None:
        if loss != "mse":
            return None
        del measures["mse"], measures["r2"]
        measures.update(loss=baseline.mse, r2=baseline.r2)
    return measures


def not_beaten(results: dict, baseline: dict | None) -> str | None:
    """What to say when the model's eval measure (`results`: an evaluation) does not beat the
    baseline's (`... eval loss 7519 is not below 7042, that of predicting the train split's mean`); else None."""
    for key, higher in HIGHER_IS_BETTER.items():
        if baseline is None or baseline.get(key) is None or results.get(key) is None:
            continue
        ours, theirs = results[key], baseline[key]
        margin = ROUNDING * abs(theirs)
        if (ours <= theirs + margin) if higher else (ours >= theirs - margin):
            return (f"the model does not beat the baseline: eval {key} {ours:.6g} is not "
                    f"{'above' if higher else 'below'} {theirs:.6g}, that of predicting {baseline['of']}")
    return None
