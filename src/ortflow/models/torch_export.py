"""A torch module as the forward ONNX model that ONNX Runtime's training graphs are built on."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import external_data
from ..errors import ModelError
from . import LOGITS, batchnorm

log = logging.getLogger("ortflow.build_artifacts")

# ORT 1.19's gradient builder fails on opset 17's one-output LayerNormalization.
OPSET = 16


def export_torch(module, manifest: dict, path: Path):
    """torch -> ONNX (written to `path` and returned) with the batch dimension dynamic, in training mode and
    without constant folding, so that every parameter stays an initializer;
    with export_fixes' repairs (torch.diff, cumsum, the attention's dropout, the embedding's padding row,
    initializers merged by value, the shapes for ONNX Runtime's gradient builder),
    and the buffers (BatchNorm's running statistics) as they were before the export ran the module."""
    import onnx
    import torch

    from . import export_fixes, user

    export_fixes.register_symbolics(OPSET)
    export_fixes.check_embeddings(module)
    features = user.forward_features(module, manifest)
    example = tuple(torch.zeros([2, *f["shape"]], dtype=getattr(torch, f["dtype"])) for f in features)
    names = [f["name"] for f in features]
    buffers = batchnorm.buffers_before_export(module)
    try:
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=names,
            output_names=[LOGITS],
            dynamic_axes={name: {0: "batch"} for name in [*names, LOGITS]},
            opset_version=OPSET,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            dynamo=False,
        )
    except torch.onnx.errors.UnsupportedOperatorError as error:
        raise export_fixes.unsupported_operator(error, type(module).__name__, OPSET) from None
    except torch.onnx.errors.SymbolicValueError as error:  # its message goes on with the traced graph
        problem = str(error).splitlines()[0].split("  [Caused by")[0].strip()
        raise ModelError(f"model.path: torch.onnx cannot export {type(module).__name__}: {problem}") from None
    # A model over 2 GB comes with one external data file per tensor (initializers and Constant
    # nodes' values), named after it: they are read in and written again as one
    # (external_data.save_model), or not at all.
    from onnx.external_data_helper import _get_all_tensors

    exported = onnx.load(str(path), load_external_data=False)
    scattered = {entry.value for tensor in _get_all_tensors(exported)
                 for entry in tensor.external_data if entry.key == "location"}
    if scattered:
        onnx.load_external_data_for_model(exported, str(path.parent))
        for name in scattered:
            (path.parent / name).unlink()
    untied = export_fixes.untie_initializers(exported, module)
    if untied:
        log.warning("model.path: %s stayed in eval mode while exported, so torch.onnx merged its parameters and "
                    "buffers of equal value; each has its own initializer again: %s", type(module).__name__,
                    sorted(untied))
    unread_inputs(exported, module, features)
    export_fixes.give_dropout_its_mask(exported)
    batchnorm.restore_buffers(exported, buffers)
    export_fixes.infer_shapes(exported)
    external_data.save_model(exported, path)
    return exported


def unread_inputs(exported, module, features: list[dict]) -> list[str]:
    """The features a module takes but does not read (`ignored_inputs`: a tokenizer's
    token_type_ids for a model without them), which torch.onnx leaves out of the graph:
    added back (`add_inputs`)."""
    ignored = getattr(module, "ignored_inputs", ())
    return add_inputs(exported, [{"name": f["name"], "dtype": f["dtype"], "shape": ["batch", *f["shape"]]}
                                 for f in features if f["name"] in ignored])


def add_inputs(model, inputs: list[dict]) -> list[str]:
    """Each of `inputs` (name, dtype, shape with the batch: model.json's) that the ONNX `model`
    lacks, added as an input that nothing reads: the model then takes every feature the data has, as
    the data's consumers (training, evaluation, inference) feed them. Torch's exporter and
    ONNX Runtime's inference export both leave out an input that nothing reads."""
    import onnx

    present = {value.name for value in model.graph.input}
    added = []
    for value in inputs:
        if value["name"] not in present:
            elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(value["dtype"]))
            model.graph.input.append(onnx.helper.make_tensor_value_info(value["name"], elem, value["shape"]))
            added.append(value["name"])
    return added
