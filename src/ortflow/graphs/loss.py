"""The loss: `model.loss` chosen for the data's task and label, and the ONNX Runtime
block that computes it behind a label input shaped like the data's."""

from __future__ import annotations

import numpy as np

from ..data.manifest import Column, Manifest
from ..errors import ModelError
from ..models import CLASS_LOSSES, IGNORE_INDEX
from ..models.logits import Logits
from ..onnx_nodes import attributes

# ORT's loss blocks by config name; bce_with_logits is ortflow's own (models/losses.py).
LOSS_BLOCKS = {"cross_entropy": "CrossEntropyLoss", "mse": "MSELoss", "l1": "L1Loss"}


def resolve_loss(loss: str, manifest: Manifest, model_task: str | None = None) -> str:
    """`model.loss`, with `auto` chosen by the task (the data's, and a `kind: transformers`
    model's `model_task`), checked against the label."""
    task, label = manifest.task, manifest.label
    if loss == "auto" and model_task:
        from ..models.hugging_face import default_loss, task_of

        loss = default_loss(task_of(model_task, manifest), manifest)
    if loss == "auto":
        loss = "mse" if task == "regression" else "cross_entropy"
    integral = np.issubdtype(np.dtype(label.dtype), np.integer) or label.dtype == "bool"
    described = f"the data's label {label.name!r} is {label.dtype} (task {task})"
    if loss in CLASS_LOSSES and not integral:
        raise ModelError(
            f"model.loss: {loss!r} needs integer class labels but {described}; "
            "use mse, l1 or bce_with_logits for float targets, or set data.task: classification"
        )
    if loss in ("mse", "l1") and integral:
        raise ModelError(
            f"model.loss: {loss!r} compares outputs with float targets but {described}; use cross_entropy for classes"
        )
    if loss == "bce_with_logits" and integral and manifest.num_classes != 2:
        raise ModelError(
            f"model.loss: 'bce_with_logits' needs float targets in [0, 1] or two classes but {described} "
            f"with {manifest.num_classes} classes; use cross_entropy"
        )
    return loss


def loss_block(loss: str, label: Column, logits: Logits):
    """ORT's loss block behind a label input that has the data's name, dtype
    and shape ([batch, *label shape]); ORT's own blocks would derive the label's
    shape from the logits, which is wrong for [batch, classes, time] logits.
    Cross-entropy ignores labels of IGNORE_INDEX: its mean is over the other
    elements, as torch's cross_entropy(ignore_index=-100) is.
    The label is cast to the type the loss wants (integer 0/1 labels to float
    for bce_with_logits; a no-op otherwise). Logits that differ from the label's
    layout in size-1 dimensions only are reshaped to it (models/logits.py)."""
    import onnx
    from onnxruntime.training import onnxblock

    from ..models import losses

    class LabelledLoss(onnxblock.Block):
        def __init__(self):
            super().__init__()
            if loss == "bce_with_logits":
                self.inner = losses.stable_bce_with_logits()
            elif loss in CLASS_LOSSES:
                self.inner = getattr(onnxblock.loss, LOSS_BLOCKS[loss])(ignore_index=IGNORE_INDEX)
            else:
                self.inner = getattr(onnxblock.loss, LOSS_BLOCKS[loss])()

        def reshaped(self, name: str, shape: list[int], to: str) -> str:
            """`name` reshaped to `shape` by a Reshape node, as the tensor `<name>.<to>`."""
            dims, out = f"{name}.{to}_shape", f"{name}.{to}"
            self.base.graph.initializer.append(onnx.numpy_helper.from_array(np.array(shape, np.int64), dims))
            self.base.graph.node.append(onnx.helper.make_node("Reshape", [name, dims], [out]))
            return out

        def build(self, logits_name: str):
            if logits.reshape:  # Reshape's 0 keeps the batch (and classes) as they are: [N, C, 1, 1] -> [N, C]
                kept = [0, 0] if loss in CLASS_LOSSES else [0]
                logits_name = self.reshaped(logits_name, [*kept, *label.shape], "label_layout")
            transposed = loss in CLASS_LOSSES and classes_last(self.base.graph, logits_name)
            if transposed:  # [batch, time, classes] -> [batch * time, classes]: Flatten is a view
                logits_name = f"{transposed}.tokens"
                self.base.graph.node.append(onnx.helper.make_node("Flatten", [transposed], [logits_name], axis=2))
            elem_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(label.dtype))
            shape = ["batch", *label.shape]
            self.base.graph.input.append(onnx.helper.make_tensor_value_info(label.name, elem_type, shape))
            # A node's output, not the graph input itself: ORT's loss blocks
            # look for their target among node arguments and add another input otherwise.
            wanted = onnx.TensorProto.INT64 if loss in CLASS_LOSSES else onnx.TensorProto.FLOAT
            target = f"{label.name}.{onnx.TensorProto.DataType.Name(wanted).lower()}"
            self.base.graph.node.append(onnx.helper.make_node("Cast", [label.name], [target], to=wanted))
            if transposed:
                target = self.reshaped(target, [-1], "tokens")
            return self.inner(logits_name, target)

    return LabelledLoss()


def classes_last(graph, logits: str) -> str | None:
    """The [batch, time, classes] tensor whose Transpose (perm [0, 2, 1]) made `logits`, if one did: a
    language model's logits in the layout the loss takes ([batch, classes, time], models/gpt.py).
    ONNX Runtime's cross-entropy on [N, C, D] transposes them back to [N * D, C] inside, forward
    and backward, and the model's Transpose has its own gradient: on the tensor before it,
    flattened, the loss does neither (GPT-2 124M's logits are 103 MB at 4 x 128 tokens)."""
    producer = next((node for node in graph.node if logits in node.output), None)
    if producer is None or producer.op_type != "Transpose":
        return None
    return producer.input[0] if attributes(producer).get("perm") == [0, 2, 1] else None
