"""The models that `build_artifacts` turns into training graphs.

Built in (torch modules, exported to ONNX by torch_export.py): `mlp`, `cnn`, `gpt`.
Brought by the user (user.py): `onnx` (a file) and `torch` (an import path).
Every model takes the data's features as inputs named like them and returns
one output, `logits`. A `manifest` argument in this package is a split's manifest
(data/manifest.py's Manifest, read by its attributes: data/ is the layer above, so
it is not imported here).
"""

from __future__ import annotations

from ..errors import ModelError

LOGITS = "logits"
CLASS_LOSSES = ("cross_entropy",)
# A class label of -100 (transformers' value) is no class: padding and sub-tokens carry it,
# and the cross-entropy, accuracy and per-class counts leave it out.
IGNORE_INDEX = -100
# A sequence-to-sequence model's third input: its target shifted right (data/tokenizer.py's encode_targets).
DECODER_INPUT_IDS = "decoder_input_ids"
# The token windows of text (data.source text, a .txt file) are one feature of this name.
TEXT_WINDOWS = "x"


def is_float(tensor) -> bool:
    """Whether an ONNX tensor (an initializer) holds floating-point numbers: the candidate parameters."""
    import onnx

    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    return tensor.data_type in floats


def output_shape(loss: str, manifest) -> list[int]:
    """Per-sample shape of a built-in model's logits: one score per class for
    cross-entropy (classes first, then the label's own dims, as
    SoftmaxCrossEntropyLoss wants), else the label's shape, which the loss
    compares element by element."""
    label_shape = manifest.label.shape
    if loss in CLASS_LOSSES:
        return [manifest.num_classes, *label_shape]
    return list(label_shape)


def built_in(model, manifest, loss: str):
    """The torch module of a built-in `model.kind`, with freshly initialised
    weights (the caller seeds torch)."""
    from . import cnn, gpt, mlp

    features = manifest.features
    kind = model.kind
    if len(features) != 1:
        names = [f.name for f in features]
        raise ModelError(
            f"model.kind '{kind}' takes one feature array; the data has {len(features)}: {names} "
            "(use one feature, or bring your own model with model.kind onnx or torch)"
        )
    shape = list(features[0].shape)
    if kind == "mlp":
        return mlp.MLP(shape, model.hidden, output_shape(loss, manifest))
    if kind == "cnn":
        return cnn.SqueezeNet(shape, output_shape(loss, manifest), max(model.width // 8, 2))
    if kind == "gpt":
        if manifest.task != "language_model" or loss != "cross_entropy" or len(shape) != 1:
            raise ModelError(
                f"model.kind 'gpt' is trained by next-token cross_entropy on token windows; the data is "
                f"task {manifest.task!r} with feature shape {shape} and model.loss is {loss!r}"
            )
        return gpt.GPT(
            manifest.num_classes, shape[0], model.width, model.heads, model.layers, model.tied
        )
    raise ModelError(f"model.kind {kind!r} is not a built-in model")
