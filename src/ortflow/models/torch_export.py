"""A torch module as the forward ONNX model that ONNX Runtime's training graphs are built on."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import external_data
from ..errors import ModelError
from . import DECODER_INPUT_IDS, LOGITS, batchnorm

log = logging.getLogger("ortflow.build_artifacts")

# ORT 1.19's gradient builder fails on opset 17's one-output LayerNormalization.
OPSET = 16
# The name of a text model's dynamic sequence dimension (dim 1 of its token-id inputs).
SEQUENCE = "sequence"
# A sequence-to-sequence model's target (its decoder's inputs and its logits) has a length of its own:
# one name for both lengths would tell ONNX Runtime they are equal, and it plans memory by that.
TARGET_SEQUENCE = "target_sequence"


def sequence_name(feature: str) -> str:
    return TARGET_SEQUENCE if feature == DECODER_INPUT_IDS else SEQUENCE


def export_torch(module, manifest, path: Path):
    """torch -> ONNX (written to `path`, returned): the batch (and a text model's sequence, `sequence_axes`)
    dynamic, in training mode, no constant folding (every parameter stays an initializer); export_fixes' repairs
    (torch.diff, cumsum, the attention's dropout, padding rows' lookups marked, initializers merged by value,
    shapes for ONNX Runtime's gradient builder); the buffers (BatchNorm's running statistics) as before the export."""
    import onnx
    import torch

    from . import export_fixes, user

    export_fixes.register_symbolics(OPSET)
    export_fixes.check_embeddings(module)
    features = user.forward_features(module, manifest)
    example = tuple(torch.zeros([2, *f.shape], dtype=getattr(torch, f.dtype)) for f in features)
    names = [f.name for f in features]
    buffers = batchnorm.buffers_before_export(module)
    sequence = sequence_axes(module, manifest, features, example)
    axes = {name: {0: "batch"} | sequence.get(name, {}) for name in [*names, LOGITS]}
    try:
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=names,
            output_names=[LOGITS],
            dynamic_axes=axes,
            opset_version=OPSET,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            dynamo=False,
            export_params=False,  # the weights are added below, one tensor at a time (weights_as_initializers)
        )
    except torch.onnx.errors.UnsupportedOperatorError as error:
        raise export_fixes.unsupported_operator(error, type(module).__name__, OPSET) from None
    except torch.onnx.errors.SymbolicValueError as error:  # its message goes on with the traced graph
        problem = str(error).splitlines()[0].split("  [Caused by")[0].strip()
        raise ModelError(f"model.path: torch.onnx cannot export {type(module).__name__}: {problem}") from None
    # A graph over 2 GB (Constant nodes' values) comes with one external data file per tensor, named
    # after it: they are read in and written again as one (external_data.save_model), or not at all.
    from onnx.external_data_helper import _get_all_tensors

    exported = onnx.load(str(path), load_external_data=False)
    scattered = {entry.value for tensor in _get_all_tensors(exported)
                 for entry in tensor.external_data if entry.key == "location"}
    if scattered:
        onnx.load_external_data_for_model(exported, str(path.parent))
        for name in scattered:
            (path.parent / name).unlink()
    weights_as_initializers(exported, module)
    untied = export_fixes.untie_initializers(exported, module)
    if untied:
        log.warning("model.path: %s stayed in eval mode while exported, so torch.onnx merged its parameters and "
                    "buffers of equal value; each has its own initializer again: %s", type(module).__name__,
                    sorted(untied))
    unread_inputs(exported, module, features, axes)
    export_fixes.give_dropout_its_mask(exported)
    export_fixes.mark_padding_rows(exported, module)
    batchnorm.restore_buffers(exported, buffers)
    export_fixes.infer_shapes(exported)
    return external_data.save_and_reload(exported, path)


def weights_as_initializers(model, module) -> None:
    """The module's parameters and buffers, which torch.onnx.export(export_params=False) leaves
    as graph inputs named like them, made the model's initializers, copied one tensor at a time.
    With export_params=True torch's exporter holds the module, its ONNX graph with every weight,
    that graph serialized and parsed again at once: 4.6 W on an 86M GPT, 2 W this way."""
    import torch

    state = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    weights = [value for value in model.graph.input if value.name in state]
    inputs = [value for value in model.graph.input if value.name not in state]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    for value in weights:
        tensor = state[value.name].detach().cpu().contiguous()
        model.graph.initializer.add(name=value.name, dims=tensor.shape, data_type=value.type.tensor_type.elem_type,
                                    raw_data=tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def sequence_features(manifest, features) -> list[str]:
    """The features that are a text's token positions (token ids, their attention mask and types):
    every one-dimensional feature of text, read as windows of `data.context` (a language model) or
    through data.tokenizer."""
    if manifest.task != "language_model" and not manifest.tokenizer:
        return []
    return [f.name for f in features if len(f.shape) == 1 and not f.dtype.startswith("float")]


def sequence_axes(module, manifest, features, example: tuple) -> dict[str, dict[int, str]]:
    """Input or output name -> {its sequence dimension: SEQUENCE}, for a text model that takes another length:
    dim 1 of the token features, and the dimension of the logits that follows their length, found
    by running the module at the training length and one shorter. None for a module that cannot
    (the built-in gpt adds its whole position table, `data.context` rows, to every window)."""
    import torch

    sequences = sequence_features(manifest, features)
    length = next((f.shape[0] for f in features if f.name in sequences), 0)
    if length < 2:
        return {}
    shorter = tuple(tensor[:, :length - 1] if f.name in sequences else tensor
                    for f, tensor in zip(features, example))
    try:
        with torch.no_grad():
            full, short = module(*example).shape, module(*shorter).shape
    except Exception as error:  # any failure means the module takes its training length only
        log.info("%s takes token sequences of data.context=%d only (%s: %s): its ONNX model's sequence dimension "
                 "stays fixed", type(module).__name__, length, type(error).__name__, str(error).strip()[:120])
        return {}
    moved = [axis for axis, (a, b) in enumerate(zip(full, short)) if a != b]
    if len(full) != len(short) or [(full[axis], short[axis]) for axis in moved] not in ([], [(length, length - 1)]):
        log.info("%s's logits %s at length %d change to %s at length %d, not in one dimension of that length: "
                 "its ONNX model's sequence dimension stays fixed", type(module).__name__, list(full), length,
                 list(short), length - 1)
        return {}
    # The logits follow the target's length, where there is one, else the text's.
    logits = TARGET_SEQUENCE if DECODER_INPUT_IDS in sequences else SEQUENCE
    return {name: {1: sequence_name(name)} for name in sequences} | ({LOGITS: {moved[0]: logits}} if moved else {})


def unread_inputs(exported, module, features, axes: dict[str, dict[int, str]]) -> list[str]:
    """The features a module takes but does not read (`ignored_inputs`: a tokenizer's
    token_type_ids for a model without them), which torch.onnx leaves out of the graph:
    added back (`add_inputs`), with the dynamic `axes` of the export."""
    import onnx

    ignored = getattr(module, "ignored_inputs", ())
    values = [onnx.helper.make_tensor_value_info(
        f.name, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(f.dtype)),
        [axes.get(f.name, {}).get(axis, size) for axis, size in enumerate([None, *f.shape])])
        for f in features if f.name in ignored]
    return add_inputs(exported, values)


def add_inputs(model, inputs) -> list[str]:
    """Each of `inputs` (ONNX ValueInfos) that the ONNX `model` lacks, added as an input that
    nothing reads: the model then takes every feature the data has, as the data's consumers
    (training, evaluation, inference) feed them. Torch's exporter and ONNX Runtime's inference
    export both leave out an input that nothing reads."""
    present = {value.name for value in model.graph.input}
    added = [value for value in inputs if value.name not in present]
    model.graph.input.extend(added)
    return [value.name for value in added]
