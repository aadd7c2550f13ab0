"""The inference model, as export and quantize use it: its output, its inputs from a batch,
the training loss of its logits, and its metadata properties. Its ONNX Runtime session
is sessions.py's `inference_session`."""

from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..evaluation import label_layout
from ..graphs.description import ModelDescription
from ..models import IGNORE_INDEX


def inference_output(info: ModelDescription) -> str:
    """The inference model's output: the model's own, which is the logits unless the model ends in a Softmax."""
    return info.inference_output


def input_feeds(session, batch: dict) -> dict:
    return {i.name: batch[i.name] for i in session.get_inputs()}


def loss_of(logits: np.ndarray, labels: np.ndarray, loss: str) -> float:
    """The training loss (`model.json` `loss`, a mean like ORT's loss blocks) of
    an inference model's logits, which have no loss output of their own."""
    logits = label_layout(logits, labels, loss).astype(np.float64)
    if loss == "cross_entropy":  # logits [batch, classes, ...], labels [batch, ...]; IGNORE_INDEX left out
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        labels = labels.astype(np.int64)
        kept = labels != IGNORE_INDEX
        picked = np.take_along_axis(log_probs, np.where(kept, labels, 0)[:, None], axis=1)[:, 0]
        return float(-picked[kept].mean()) if kept.any() else 0.0
    target = labels.astype(np.float64).reshape(logits.shape)
    if loss == "mse":
        return float(((logits - target) ** 2).mean())
    if loss == "l1":
        return float(np.abs(logits - target).mean())
    if loss == "bce_with_logits":
        return float((np.maximum(logits, 0) - logits * target + np.log1p(np.exp(-np.abs(logits)))).mean())
    raise ModelError(f"model.json: loss {loss!r} is not one ortflow trains with")


def set_metadata(model, props: dict) -> None:
    """Add `props` to the model's metadata properties, keeping the ones it has (a user model's own)."""
    import onnx

    merged = {p.key: p.value for p in model.metadata_props}
    merged.update({key: str(value) for key, value in props.items()})
    onnx.helper.set_model_props(model, merged)
