"""BatchNorm in ortflow's graphs: batch statistics and updated running
statistics in training, the running statistics in evaluation and export.

torch exports a module in training mode (build_artifacts.export_torch), so each BatchNorm
is `BatchNormalization(x, scale, bias, running_mean, running_var)` with
`training_mode=1` and three outputs: y, and the running mean and variance
updated with torch's momentum (ONNX's `momentum` is 1 - torch's). The running
statistics are initializers, hence non-trainable parameters of the checkpoint
(they are not among the torch module's parameters, so split_parameters freezes
them), sharded, merged and resharded like any other.

ONNX Runtime's generate_artifacts then leaves two things to do:
- its eval graph sets `training_mode=0` but keeps the three outputs, which
  ONNX Runtime refuses ("number of op outputs should be 1 when Training_mode =
  False"): `inference_mode` keeps y alone, so evaluation, and export (written
  from the eval graph), normalize with the running statistics;
- its training graph (where BatchNormalization became com.microsoft's
  BatchNormInternal) computes the updated statistics and drops them:
  `expose_running_stats` makes them graph outputs, which training copies into
  the checkpoint state after every forward (train/running_stats.py).

An ONNX file (`model.kind: onnx`) usually holds BatchNorms in inference mode, as
the model zoo and torch's eval-mode export write them: `to_training_mode` switches
those whose running statistics are initializers to training mode, so that they
train as the same model does in torch's train mode, and `running_statistics`
keeps the statistics out of the trainable parameters.

Dropout needs nothing here: torch writes it with `training_mode` True, and the
eval graph's generation empties that input, so it drops in training only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..artifacts import Artifacts
from ..errors import ModelError
from ..onnx_nodes import attributes

log = logging.getLogger("ortflow.build_artifacts")
# BatchNormalization has had a training_mode attribute since this opset.
TRAINING_MODE_OPSET = 14


def _training_mode(node) -> int:
    return attributes(node).get("training_mode", 0)


def buffers_before_export(module) -> dict:
    """The module's buffers (name -> numpy copy), taken before torch.onnx.export
    runs it in training mode: that run updates every BatchNorm's running statistics
    once (from the example batch of zeros) and exports the updated values.
    Refused: a BatchNorm with momentum=None (a cumulative average over all
    batches, which the exported graph cannot express), and one with
    track_running_stats=False (torch.onnx asserts on it with a dynamic batch)."""
    import torch

    for name, layer in module.named_modules():
        if not isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
            continue
        where = f"model.path: {type(module).__name__}.{name} ({type(layer).__name__})"
        if not layer.track_running_stats:
            raise ModelError(f"{where} has track_running_stats=False, which torch.onnx cannot export with a dynamic "
                             "batch dimension; keep running statistics (track_running_stats=True)")
        if layer.momentum is None:
            raise ModelError(f"{where} has momentum=None, a cumulative average that ortflow's graphs cannot update; "
                             "give it a momentum (torch's default is 0.1)")
    return {name: buffer.detach().cpu().numpy().copy() for name, buffer in module.named_buffers()}


def restore_buffers(model, buffers: dict) -> int:
    """Set the exported initializers named like the module's buffers back to
    `buffers_before_export`; returns how many differed."""
    import numpy as np
    from onnx import numpy_helper

    restored = 0
    for index, tensor in enumerate(model.graph.initializer):
        before = buffers.get(tensor.name)
        if before is not None and not np.array_equal(numpy_helper.to_array(tensor), before):
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(before, tensor.name))
            restored += 1
    return restored


def running_statistics(model) -> set[str]:
    """The initializers that BatchNormalization nodes read as running mean and variance."""
    initializers = {t.name for t in model.graph.initializer}
    return {name for node in model.graph.node if node.op_type == "BatchNormalization"
            for name in node.input[3:5] if name in initializers}


def to_training_mode(model, where: str) -> int:
    """Switch every BatchNormalization in inference mode whose running statistics
    are initializers to training mode, with the running mean and variance as its
    outputs (ONNX's form, which torch's train-mode export writes); returns how many.
    The model must be at opset TRAINING_MODE_OPSET or later."""
    import onnx

    statistics, changed = running_statistics(model), 0
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or _training_mode(node) or not set(node.input[3:5]) <= statistics:
            continue
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute("training_mode", 1)])
        del node.output[1:]
        node.output.extend([f"{node.output[0]}.running_mean", f"{node.output[0]}.running_var"])
        changed += 1
    if changed:
        log.info("%s: %d BatchNormalization nodes switched to training mode: their running statistics update as "
                 "in torch's train mode, and evaluation and the export use them", where, changed)
    return changed


def check_trainable(base, trainable: list[str]) -> None:
    """A running statistic has no gradient (ONNX Runtime's gradient builder would
    fail without naming it): refuse one named in `model.trainable`."""
    for node in base.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        for statistic, name in zip(("mean", "variance"), node.input[3:5]):
            if name in trainable:
                raise ModelError(
                    f"model.trainable: {name!r} is the running {statistic} of BatchNormalization node "
                    f"{node.name or node.output[0]!r}, which training updates from the batches, not by gradients; "
                    "leave it out of model.trainable"
                )


def inference_mode(eval_model) -> int:
    """Keep only y of every BatchNormalization that ONNX Runtime's eval graph put
    in inference mode; returns how many were changed."""
    changed = 0
    for node in eval_model.graph.node:
        if node.op_type == "BatchNormalization" and not _training_mode(node) and len(node.output) > 1:
            del node.output[1:]
            changed += 1
    return changed


def expose_running_stats(training_model) -> dict[str, str]:
    """Make the running mean and variance of every training-mode BatchNorm, updated
    as torch updates them, outputs of the training graph; returns {output: parameter}.

    ONNX Runtime's kernel updates the variance with the batch's biased variance
    (divided by n, the elements per channel), torch with the unbiased one (n - 1).
    The kernel's updated variance is corrected by (1 - momentum) x biased / (n - 1),
    the biased variance read back from the kernel's saved 1 / sqrt(var + epsilon).
    (ONNX Runtime declares the kernel's running statistics aliases of its inputs:
    left unread, they overwrite the checkpoint's statistics with the biased
    update; as graph outputs they came out as buffers of their own, and either
    way training writes the corrected values back after the forward.) A BatchNorm
    whose statistics are not parameters (computed in the graph) keeps none."""
    inputs = {i.name: i for i in training_model.graph.input}
    stats = {}
    for node in list(training_model.graph.node):
        if node.op_type != "BatchNormInternal" or not all(name in inputs for name in node.input[3:5]):
            continue
        mean, var = _corrected(training_model.graph, node)
        for output, parameter in ((mean, node.input[3]), (var, node.input[4])):
            info = _value_like(inputs[parameter], output)
            training_model.graph.output.append(info)
            stats[output] = parameter
    return stats


def _value_like(value, name: str):
    import onnx

    info = onnx.ValueInfoProto()
    info.CopyFrom(value)
    info.name = name
    return info


def _corrected(graph, node) -> tuple[str, str]:
    """Nodes after BatchNormInternal `node` (outputs y, running mean, running var,
    saved mean, saved 1/sqrt(var + epsilon)) giving torch's updated running variance;
    returns the names of the running mean and the corrected variance."""
    import numpy as np
    import onnx

    x, running_mean, running_var, inv_std = node.input[0], node.output[1], node.output[2], node.output[4]
    found = attributes(node)
    prefix = f"{running_var}.unbiased"

    def constant(name: str, value) -> str:
        graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value, np.float32), f"{prefix}.{name}"))
        return f"{prefix}.{name}"

    def op(op_type: str, *inputs: str, **kwargs) -> str:
        output = f"{prefix}.{len(graph.node)}"
        graph.node.append(onnx.helper.make_node(op_type, list(inputs), [output], **kwargs))
        return output

    # biased variance = 1 / inv_std^2 - epsilon; n = elements of x / channels
    biased = op("Sub", op("Reciprocal", op("Mul", inv_std, inv_std)), constant("epsilon", found["epsilon"]))
    n = op("Cast", op("Div", op("Size", x), op("Size", running_mean)), to=onnx.TensorProto.FLOAT)
    share = op("Div", constant("update", 1.0 - found.get("momentum", 0.9)), op("Sub", n, constant("one", 1.0)))
    return running_mean, op("Add", running_var, op("Mul", biased, share))


def adapt(folder: Path) -> dict[str, str]:
    """Apply `inference_mode` to the eval graph and `expose_running_stats` to
    the training graph in `folder` (generate_artifacts' output); returns the
    running statistics {training graph output: parameter} (empty without BatchNorm)."""
    import onnx

    eval_path, training_path = Artifacts(folder).eval_model, Artifacts(folder).training_model
    eval_model = onnx.load(str(eval_path))
    if inference_mode(eval_model):
        onnx.save(eval_model, str(eval_path))
    training_model = onnx.load(str(training_path))
    stats = expose_running_stats(training_model)
    if stats:
        onnx.save(training_model, str(training_path))
    return stats
