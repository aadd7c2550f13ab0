"""Evaluation, shared by training (the eval graph of the Module, over every rank's
part of the eval split), export (the exported model against the eval graph) and
quantize (fp32 against int8): the graphs' inputs from a batch, a call's loss and
logits, and the results (mean loss, accuracy, perplexity; in training, each
class's accuracy too) from summed batch totals."""

from __future__ import annotations

import math

import numpy as np

from ..data.shards import ShardReader
from ..models import CLASS_LOSSES, IGNORE_INDEX


def feeds(batch: dict, input_names: list[str], label_input: str, data_label: str) -> list[np.ndarray]:
    return [batch[data_label] if name == label_input else batch[name] for name in input_names]


def outputs_of(result) -> tuple[float, np.ndarray | None]:
    """(loss, logits) from a Module call: the graphs return both when built with logits."""
    if isinstance(result, (list, tuple)):
        return float(result[0]), (result[1] if len(result) > 1 else None)
    return float(result), None


def label_layout(logits: np.ndarray, labels: np.ndarray, loss: str) -> np.ndarray:
    """The logits in the label's layout, as the loss takes them: [batch, classes,
    *label dims] for cross-entropy, the label's shape for the other losses. A
    model's logits may differ from it in size-1 dimensions ([N, 1000, 1, 1]
    against a flat label), which the loss reshapes away too (models/logits.py)."""
    if loss in CLASS_LOSSES:
        return logits.reshape(len(labels), logits.shape[1], *labels.shape[1:])
    return logits.reshape(labels.shape)


def batch_totals(loss: float, logits: np.ndarray | None, labels: np.ndarray, info: dict,
                 num_classes: int = 0) -> np.ndarray:
    """[loss sum, correct predictions, count] of one eval batch, then with
    `num_classes` each class's correct predictions and count: to be summed over
    batches (and ranks) and turned into results by `eval_results`. `info` is
    model.json: its task and loss. A prediction is the class of the largest logit
    (cross-entropy), or class 1 where the logit is positive (bce_with_logits on two
    classes). Labels of IGNORE_INDEX (padding, sub-tokens) count nowhere."""
    # The loss is a mean over the batch's elements (samples, or tokens for a language model)
    # that it does not ignore; a batch with none adds nothing (its mean is not a number).
    task = info["task"]
    kept = labels != IGNORE_INDEX if info["loss"] in CLASS_LOSSES else np.ones(labels.shape, dtype=bool)
    n = int(kept.sum()) if task != "regression" else len(labels)
    hits = np.zeros(labels.shape, dtype=bool)
    if logits is not None and task != "regression":
        logits = label_layout(logits, labels, info["loss"])
        predicted = np.argmax(logits, axis=1) if info["loss"] in CLASS_LOSSES else (logits > 0)
        hits = (predicted == labels) & kept
    per_class = []
    if num_classes:
        classes = labels[kept].astype(np.int64)
        per_class = [np.bincount(classes[hits[kept]], minlength=num_classes),
                     np.bincount(classes, minlength=num_classes)]
    return np.concatenate([[loss * n if n else 0.0, float(hits.sum()), n], *per_class]).astype(np.float64)


def eval_results(totals, task: str, classes: list[str] | None = None) -> dict:
    """Mean loss, and accuracy (classification) or perplexity (language model),
    from summed `batch_totals`; with `classes` (the names of the `num_classes`
    given to batch_totals) `per_class`: {name: {"accuracy", "count"}}."""
    loss_sum, correct, count = totals[:3]
    results = {"loss": loss_sum / count}
    if task == "classification":
        results["accuracy"] = correct / count
    elif task == "language_model":
        results["perplexity"] = math.exp(min(results["loss"], 50.0))
        results["accuracy"] = correct / count
    if classes:
        hits, counts = np.split(np.asarray(totals[3:]), 2)
        results["per_class"] = {name: {"accuracy": float(h / c) if c else None, "count": int(c)}
                                for name, h, c in zip(classes, hits, counts)}
    return results


def class_names(reader: ShardReader, info: dict) -> list[str] | None:
    """The names of a classifier's classes: a label of strings' own (the manifest's `classes`), else the ids."""
    if info["task"] != "classification":
        return None
    return reader.manifest.get("classes") or [str(i) for i in range(info["num_classes"])]


def evaluate(module, reader: ShardReader, comm, info: dict, batch_size: int, data_label: str,
             records: int | None = None) -> dict:
    """Mean loss over the eval split (or `records` of it, spread over the split), and
    accuracy and each class's accuracy (classification) or perplexity (language model);
    each rank evaluates its part."""
    module.eval()
    names = module.input_names()
    classes = class_names(reader, info)
    totals = np.zeros(3 + 2 * len(classes or []))
    for batch in reader.eval_batches(comm.rank, comm.world_size, batch_size, records):
        loss, logits = outputs_of(module(*feeds(batch, names, info["label"]["name"], data_label)))
        totals += batch_totals(loss, logits, batch[data_label], info, len(classes or []))
    module.train()
    return eval_results(comm.allreduce_sum(totals), info["task"], classes)
