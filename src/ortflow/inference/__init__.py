"""The inference model, as export and quantize use it: its output, an ONNX Runtime
session of it, its inputs from a batch, the training loss of its logits, and its
metadata properties."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import external_data
from ..errors import ModelError
from ..evaluation import label_layout
from ..models import IGNORE_INDEX
from ..sessions import session_options


def inference_output(info: dict) -> str:
    """The inference model's output: the model's own, which is the logits unless the model ends in a Softmax
    (model.json `outputs`; artifacts built before that distinction have only `logits`)."""
    return info["outputs"].get("inference", info["outputs"]["logits"])


def inference_session(path: Path, threads: int | None = None, also: tuple[str, ...] = (), prepacked: bool = True):
    """An ONNX Runtime CPU session; `threads` pins the intra-op pool (1 for latency figures).
    `also` names tensors inside the graph to return besides its outputs (the logits of a
    model that ends in a Softmax, model.json `outputs`), for `session.run` to ask for.
    `prepacked=False` holds the weights once, for what checks or measures values, not speed:
    by default ONNX Runtime keeps its MatMul and Gemm weights a second time, packed for
    MLAS (a 554M GPT's session: 4.5 GiB, 2.4 without)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    options = session_options(threads)
    if not prepacked:
        options.add_session_config_entry("session.disable_prepacking", "1")

    def session(model):
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    if not also:
        return session(str(path))
    proto = external_data.load_model(path, load_data=False)  # weights in external data stay in their file
    outputs = {o.name for o in proto.graph.output}
    extra = [name for name in also if name not in outputs]
    if not extra:
        return session(str(path))
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in extra)
    if not external_data.uses_external_data(proto):
        return session(proto.SerializeToString())
    # ONNX Runtime finds external data beside the model file it loads: the changed graph goes beside the original.
    with tempfile.NamedTemporaryFile(dir=Path(path).parent, suffix=".onnx") as changed:
        onnx.save(proto, changed.name)
        return session(changed.name)


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
