"""Evaluation, shared by training (the eval graph of the Module, over every rank's
part of the eval split), export (the exported model against the eval graph) and
quantize (fp32 against int8): the graphs' inputs from a batch, a call's loss and
logits, and the results (mean loss, accuracy, perplexity) from summed batch totals."""

from __future__ import annotations

import math

import numpy as np

from .data.shards import ShardReader


def feeds(batch: dict, input_names: list[str], label_input: str, data_label: str) -> list[np.ndarray]:
    return [batch[data_label] if name == label_input else batch[name] for name in input_names]


def outputs_of(result) -> tuple[float, np.ndarray | None]:
    """(loss, logits) from a Module call: the graphs return both when built with logits."""
    if isinstance(result, (list, tuple)):
        return float(result[0]), (result[1] if len(result) > 1 else None)
    return float(result), None


def batch_totals(loss: float, logits: np.ndarray | None, labels: np.ndarray, task: str) -> np.ndarray:
    """[loss sum, correct predictions, count] of one eval batch, to be summed
    over batches (and ranks) and turned into results by `eval_results`."""
    # The loss is a mean over the batch's elements (samples, or tokens for a language model).
    n = labels.size if task != "regression" else len(labels)
    correct = 0.0
    if logits is not None and task != "regression":
        correct = float((np.argmax(logits, axis=1) == labels).sum())
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


def evaluate(module, reader: ShardReader, comm, info: dict, batch_size: int, data_label: str,
             records: int | None = None) -> dict:
    """Mean loss over the eval split (or `records` of it, spread over the split), and
    accuracy (classification) or perplexity (language model); each rank evaluates its part."""
    module.eval()
    names = module.input_names()
    totals = np.zeros(3)
    for batch in reader.eval_batches(comm.rank, comm.world_size, batch_size, records):
        loss, logits = outputs_of(module(*feeds(batch, names, info["label"]["name"], data_label)))
        totals += batch_totals(loss, logits, batch[data_label], info["task"])
    module.train()
    return eval_results(comm.allreduce_sum(totals), info["task"])
