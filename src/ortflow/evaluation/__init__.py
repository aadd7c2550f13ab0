"""Evaluation, shared by training (the eval graph of the Module, over every rank's
part of the eval split), export (the exported model against the eval graph) and
quantize (fp32 against int8): the graphs' inputs from a batch, a call's loss and
logits, and the results (mean loss, accuracy, perplexity; in training, each
class's accuracy, precision, recall and F1 too, and for BIO tags per token
seqeval's entity-level scores) from summed batch totals."""

from __future__ import annotations

import math

import numpy as np

from ..data.shards import ShardReader
from ..graphs.description import ModelDescription
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


def batch_totals(loss: float, logits: np.ndarray | None, labels: np.ndarray, info: ModelDescription,
                 num_classes: int = 0, entity_tags: list[str] | None = None) -> np.ndarray:
    """[loss sum, correct predictions, count] of one eval batch, then with
    `num_classes` each class's correct predictions, count and predictions, then
    with `entity_tags` (the BIO class names of a label per token, `bio_tags`) the
    entities' [true, predicted, correct] (`entity_counts`): to be summed over
    batches (and ranks) and turned into results by `eval_results`. `info` is
    model.json: its task and loss. A prediction is the class of the largest logit
    (cross-entropy), or class 1 where the logit is positive (bce_with_logits on two
    classes). Labels of IGNORE_INDEX (padding, sub-tokens) count nowhere."""
    # The loss is a mean over the batch's elements (samples, or tokens for a language model)
    # that it does not ignore; a batch with none adds nothing (its mean is not a number).
    task = info.task
    kept = labels != IGNORE_INDEX if info.loss in CLASS_LOSSES else np.ones(labels.shape, dtype=bool)
    n = int(kept.sum()) if task != "regression" else len(labels)
    hits = np.zeros(labels.shape, dtype=bool)
    predicted = np.full(labels.shape, -1, dtype=np.int64)  # no prediction: counted as none of the classes
    if logits is not None and task != "regression":
        logits = label_layout(logits, labels, info.loss)
        predicted = np.argmax(logits, axis=1) if info.loss in CLASS_LOSSES else (logits > 0)
        hits = (predicted == labels) & kept
    per_class = []
    if num_classes:
        classes, guesses = labels[kept].astype(np.int64), predicted[kept].astype(np.int64)
        per_class = [np.bincount(classes[hits[kept]], minlength=num_classes),
                     np.bincount(classes, minlength=num_classes),
                     np.bincount(guesses[guesses >= 0], minlength=num_classes)]
    entities = [entity_counts(labels, predicted if logits is not None else None, kept, entity_tags)] \
        if entity_tags else []
    return np.concatenate([[loss * n if n else 0.0, float(hits.sum()), n], *per_class, *entities]).astype(np.float64)


def bio_tags(classes: list[str] | None, label_shape: list[int]) -> list[str] | None:
    """The class names, where they are BIO tags (O, B-type, I-type) of a label per
    token: what entity-level scores are computed of; else None."""
    if not classes or not label_shape or not any(name.startswith("B-") for name in classes):
        return None
    return classes if all(name == "O" or name[:2] in ("B-", "I-") for name in classes) else None


def entity_counts(labels: np.ndarray, predicted: np.ndarray | None, kept: np.ndarray, tags: list[str]) -> list[int]:
    """[true, predicted, correct] entities of a batch's sequences, as seqeval's
    (default, CoNLL-style) f1_score finds them: over each sequence's labelled
    positions (a word's first token), an entity a (type, start, end) span.
    `predicted` None: no logits, no predicted entities."""
    from seqeval.metrics.sequence_labeling import get_entities

    true = guessed = correct = 0
    for row, (row_labels, row_kept) in enumerate(zip(labels, kept)):
        truth = set(get_entities([tags[i] for i in row_labels[row_kept]]))
        guess = set(get_entities([tags[i] for i in predicted[row][row_kept]])) if predicted is not None else set()
        true, guessed, correct = true + len(truth), guessed + len(guess), correct + len(truth & guess)
    return [true, guessed, correct]


def scores(correct: float, predicted: float, true: float) -> dict:
    """Precision, recall and F1 from counts; 0 where a count is 0 (seqeval's and scikit-learn's zero_division)."""
    precision = correct / predicted if predicted else 0.0
    recall = correct / true if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": float(precision), "recall": float(recall), "f1": float(f1)}


def eval_results(totals, task: str, classes: list[str] | None = None, entities: bool = False) -> dict:
    """Mean loss, and accuracy (classification) or perplexity (language model),
    from summed `batch_totals`; with `classes` (the names of the `num_classes`
    given to batch_totals) `per_class`: {name: {"accuracy", "count", "precision",
    "recall", "f1"}} (accuracy is the recall); with `entities` (batch_totals had
    entity_tags) `entities`: {"precision", "recall", "f1", "count"} of the BIO spans."""
    loss_sum, correct, count = totals[:3]
    results = {"loss": loss_sum / count}
    if task == "classification":
        results["accuracy"] = correct / count
    elif task == "language_model":
        results["perplexity"] = math.exp(min(results["loss"], 50.0))
        results["accuracy"] = correct / count
    if classes:
        hits, counts, predicted = np.asarray(totals[3:3 + 3 * len(classes)]).reshape(3, len(classes))
        results["per_class"] = {name: {"accuracy": float(h / c) if c else None, "count": int(c), **scores(h, p, c)}
                                for name, h, c, p in zip(classes, hits, counts, predicted)}
    if entities:
        true, guessed, correct = totals[-3:]
        results["entities"] = {**scores(correct, guessed, true), "count": int(true)}
    return results


def class_names(reader: ShardReader, info: ModelDescription) -> list[str] | None:
    """The names of a classifier's classes: a label of strings' own (the manifest's `classes`), else the ids."""
    if info.task != "classification":
        return None
    return list(reader.manifest.classes or [str(i) for i in range(info.num_classes)])


def evaluate(module, reader: ShardReader, comm, info: ModelDescription, batch_size: int, data_label: str,
             records: int | None = None) -> dict:
    """Mean loss over the eval split (or `records` of it, spread over the split), and
    accuracy and each class's accuracy (classification) or perplexity (language model);
    each rank evaluates its part."""
    module.eval()
    names = module.input_names()
    tally = Tally(reader, info, data_label)
    for batch in reader.eval_batches(comm.rank, comm.world_size, batch_size, records):
        tally.add(batch, module(*feeds(batch, names, info.label.name, data_label)))
    module.train()
    return tally.results(comm.allreduce_sum(tally.totals))


class Tally:
    """What an evaluation sums batch by batch (batch_totals), and the results of the sums over
    every rank: on one rank's Module (evaluate) or through pipeline stages, whose last stage
    adds (training/pipeline_schedule.py)."""

    def __init__(self, reader: ShardReader, info: ModelDescription, data_label: str):
        self.info, self.data_label = info, data_label
        self.classes = class_names(reader, info)
        self.entity_tags = bio_tags(self.classes, reader.manifest.label.shape)
        self.totals = np.zeros(3 + 3 * len(self.classes or []) + (3 if self.entity_tags else 0))

    def add(self, batch: dict, outputs) -> None:
        """The eval graph's `outputs` on `batch`."""
        loss, logits = outputs_of(outputs)
        self.totals += batch_totals(loss, logits, batch[self.data_label], self.info, len(self.classes or []),
                                    self.entity_tags)

    def results(self, summed: np.ndarray) -> dict:
        return eval_results(summed, self.info.task, self.classes, entities=bool(self.entity_tags))
