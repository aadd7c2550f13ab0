"""The tensor of a model that the loss reads (its logits), and how it fits the label.

The loss takes logits in the label's layout: [batch, classes, *label dims] for
cross_entropy, the label's shape for the other losses. A model's one output is
meant to be that, but models as users bring them differ in two ways, which
`find` handles instead of refusing:

- A classifier that ends in Softmax or LogSoftmax (model-zoo files do) returns
  probabilities. Cross-entropy applies the softmax itself, so it is computed on
  the Softmax's input (found through the shape-only nodes after it): the logits
  the model's author trained. The inference model keeps the Softmax and returns
  what the user's model returns (export_model).
- Logits that differ from the label's layout in size-1 dimensions only
  ([N, 1000, 1, 1] after a global pooling, or [N, 1] from a Linear(width, 1),
  against a flat label): the loss reshapes them to it (a Reshape in front of
  it), and so does evaluation (`evaluation.label_layout`). Without it ONNX
  Runtime's cross-entropy fails on the shapes, and the other losses broadcast
  [N, 1] against [N] into [N, N] without a word.

Any other misfit, where shape inference can tell, is refused in one line naming
both shapes; where it cannot, build_artifacts' smoke step finds it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..errors import ModelError
from ..onnx_nodes import attributes
from . import CLASS_LOSSES
from .user import default_opset

log = logging.getLogger("ortflow.build_artifacts")

# Nodes that only reshape: a Softmax followed by these still makes the output probabilities.
SHAPE_ONLY = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
SOFTMAXES = ("Softmax", "LogSoftmax")


class Logits(NamedTuple):
    name: str  # the tensor the loss reads and the training and eval graphs return
    reshape: bool  # reshaped to the label's layout before the loss (they differ by size-1 dimensions only)


def find(base, loss: str, manifest) -> Logits:
    """The logits of `base` for `loss` against the data's label, logging what differs from the model's output."""
    output = base.graph.output[0].name
    shapes = per_sample_shapes(base)
    name = output
    softmax = final_softmax(base)
    node = softmax and f"{softmax.op_type} node {softmax.name or softmax.output[0]!r}"
    if softmax is not None and loss in CLASS_LOSSES and class_axis(softmax, shapes.get(softmax.input[0]),
                                                                 default_opset(base)):
        name = softmax.input[0]
        log.warning("the model's output %r comes from %s, so it is probabilities: model.loss %s is computed on the "
                    "%s's input %r (its logits), and the exported model keeps the %s", output, node, loss,
                    softmax.op_type, name, softmax.op_type)
    elif softmax is not None:
        log.warning("the model's output %r comes from %s: model.loss %s takes it as it is; end the model before the "
                    "%s if it should take logits", output, node, loss, softmax.op_type)
    label = manifest.label
    shape = shapes.get(name)
    if shape is None or fits(shape, loss, manifest, reshaped=False):
        return Logits(name, reshape=False)
    if not fits(shape, loss, manifest, reshaped=True):
        classes = f", {manifest.num_classes} classes" if loss in CLASS_LOSSES else ""
        raise ModelError(
            f"the model's {'output' if name == output else 'logits'} {name!r} is {dims(shape)} but model.loss {loss} "
            f"with the data's label {label.name!r} ({dims(label.shape)}{classes}) needs "
            f"{dims(layout(shape, loss, manifest))}; " + fix(loss)
        )
    log.warning("the model's logits %r are %s and the data's label %r is %s: the logits are reshaped to %s for "
                "model.loss %s (they differ in size-1 dimensions only)", name, dims(shape), label.name,
                dims(label.shape), dims(layout(shape, loss, manifest)), loss)
    return Logits(name, reshape=True)


def layout(shape: list, loss: str, manifest) -> list:
    """The per-sample shape the loss takes: [classes, *label dims] for cross-entropy
    (the model's classes, or the data's where the model has fewer or cannot tell),
    else the label's."""
    label = list(manifest.label.shape)
    if loss not in CLASS_LOSSES:
        return label
    classes = shape[0] if shape and shape[0] is not None else None
    if classes is None or classes < (manifest.num_classes or 0):
        classes = manifest.num_classes
    return [classes, *label]


def dims(shape: list) -> str:
    """A per-sample shape as the whole tensor's, `?` where a dimension is not static."""
    return "[" + ", ".join(["batch", *("?" if d is None else str(d) for d in shape)]) + "]"


def fix(loss: str) -> str:
    if loss in CLASS_LOSSES:
        return ("end the model with one score per class in dimension 1 (classes first, then the label's own "
                "dimensions), or reshape the label to fit")
    return "make the model's output the label's shape, or reshape the label (data.label) to fit"


def fits(shape: list, loss: str, manifest, reshaped: bool) -> bool:
    """Whether `shape` (per sample; a dim is None where not static, and then fits
    any) is the loss's layout, with at least a score per class for cross-entropy;
    `reshaped`: after a Reshape, which needs every dimension known and lets size-1
    dimensions differ."""
    label = list(manifest.label.shape)
    if loss in CLASS_LOSSES:
        if not shape or (shape[0] is not None and manifest.num_classes and shape[0] < manifest.num_classes):
            return False
        shape = shape[1:]
    if not reshaped:
        return len(shape) == len(label) and all(have is None or have == need for have, need in zip(shape, label))
    return None not in shape and [d for d in shape if d != 1] == [d for d in label if d != 1]


def per_sample_shapes(base) -> dict[str, list]:
    """Tensor name -> per-sample shape (each dim an int, or None where not static), from ONNX's shape inference."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(base)
    except Exception:  # inference fails on some valid models; the smoke step then judges the shapes
        return {}
    shapes = {}
    for value in [*inferred.graph.value_info, *inferred.graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and len(tensor.shape.dim) >= 1:
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim[1:]]
    return shapes


def final_softmax(base):
    """The Softmax or LogSoftmax node that the model's output comes from through shape-only nodes, or None."""
    producers = {name: node for node in base.graph.node for name in node.output}
    node = producers.get(base.graph.output[0].name)
    while node is not None and node.op_type in SHAPE_ONLY:
        node = producers.get(node.input[0])
    return node if node is not None and node.op_type in SOFTMAXES else None


def class_axis(softmax, input_shape: list | None, opset: int) -> bool:
    """Whether the softmax normalizes over dimension 1, the classes (one over
    another axis is no classifier's: its output is left as it is). Before opset
    13 a Softmax normalizes over its input flattened from `axis` (default 1) on,
    which is over the classes when the dimensions after them are 1."""
    legacy = opset < 13
    axis = attributes(softmax).get("axis", 1 if legacy else -1)
    if input_shape is None:
        return axis == 1 and not legacy
    if axis < 0:
        axis += len(input_shape) + 1
    return axis == 1 and (not legacy or all(d == 1 for d in input_shape[1:]))
