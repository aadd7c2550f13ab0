"""Evaluation, shared by training (the eval graph of the Module, over every rank's
part of the eval split), export (the exported model against the eval graph) and
quantize (fp32 against int8): the graphs' inputs from a batch, a call's loss and
logits, and the results (mean loss, accuracy, perplexity) from summed batch totals."""

from __future__ import annotations

import math

import numpy as np

from .data.shards import ShardReader
from .models import CLASS_LOSSES


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


def batch_totals(loss: float, logits: np.ndarray | None, labels: np.ndarray, info: dict) -> np.ndarray:
    """[loss sum, correct predictions, count] of one eval batch, to be summed
    over batches (and ranks) and turned into results by `eval_results`. `info`
    is model.json: its task and loss. A prediction is the class of the largest
    logit (cross-entropy), or class 1 where the logit is positive (bce_with_logits
    on two classes)."""
    # The loss is a mean over the batch's elements (samples, or tokens for a language model).
    task = info["task"]
    n = labels.size if task != "regression" else len(labels)
    correct = 0.0
    if logits is not None and task != "regression":
        logits = label_layout(logits, labels, info["loss"])
        predicted = np.argmax(logits, axis=1) if info["loss"] in CLASS_LOSSES else (logits > 0)
        correct = float((predicted == labels).sum())
    return np.array([loss * n, correct, n], dtype=np.float64)


def eval_results(totals, task: str) -> dict:
    """Mean loss, and accuracy (classification) or perplexity (language model), from summed `batch_totals`."""
    loss_sum, correct, count = totals
    results = {"loss": loss_sum / count}
    if task == "classification":
        results["accuracy"] = correct / count
    elif task == "language_model":
        results["perplexity"] = math.exp(min(results["loss"], 50.0))
        results["accuracy"] = correct / count
    return results


def evaluate(module, reader: ShardReader, comm, info: dict, batch_size: int, data_label: str) -> dict:
    """Mean loss over the whole eval split, and accuracy (classification) or
    perplexity (language model); each rank evaluates its part."""
    module.eval()
    names = module.input_names()
    totals = np.zeros(3)
    for batch in reader.eval_batches(comm.rank, comm.world_size, batch_size):
        loss, logits = outputs_of(module(*feeds(batch, names, info["label"]["name"], data_label)))
        totals += batch_totals(loss, logits, batch[data_label], info)
    module.train()
    return eval_results(comm.allreduce_sum(totals), info["task"])
