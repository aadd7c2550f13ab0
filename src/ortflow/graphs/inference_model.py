"""The inference model of a trained checkpoint: the eval graph cut down to the model's output,
its parameters made initializers, written one tensor at a time.

ONNX Runtime's `Module.export_model_for_inferencing` does the same from a training Module
(orttraining/training_api/module.cc): it keeps the nodes that the outputs need, drops the
inputs that nothing reads, and makes each parameter input an initializer. Doing so it holds
the Module's weights, the model with every weight and that model's bytes at once, 3.3 times
the weights at 554M parameters (docs/benchmarks.md). Here the eval graph is read without
weights and each parameter goes from the checkpoint's arrays (views of its file) to the
model's external data file on its own, so that writing holds one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .. import external_data
from ..errors import ModelError
from ..onnx_nodes import reads


def inference_graph(eval_model: Path, output: str):
    """The eval graph of build_artifacts (read without weights) with `output` as its one output,
    only the nodes that `output` needs, and only the inputs that they read: the data's features
    and the parameters, which stay inputs until `add_weights` makes them initializers."""
    import onnx

    model = external_data.load_model(eval_model, load_data=False)
    graph = model.graph
    described = {value.name: value for value in [*graph.value_info, *graph.input, *graph.output]}
    if output not in described and output not in {name for node in graph.node for name in node.output}:
        raise ModelError(f"{eval_model}: no value {output!r} to export as the model's output; "
                         "run build_artifacts again")
    value = onnx.ValueInfoProto()
    value.CopyFrom(described.get(output, onnx.helper.make_empty_tensor_value_info(output)))
    del graph.output[:]
    graph.output.append(value)
    prune(model)
    constants_as_initializers(model)
    return model


def constants_as_initializers(model) -> None:
    """Each Constant node holding a tensor made an initializer of its output's name, as ONNX
    Runtime's export has them (its graph turns Constant nodes into initializers when it loads)."""
    for node in [node for node in model.graph.node if node.op_type == "Constant"]:
        if [attribute.name for attribute in node.attribute] != ["value"]:
            continue  # value_float, value_ints, ...: a node is as good, and rare in exported graphs
        tensor = model.graph.initializer.add()
        tensor.CopyFrom(node.attribute[0].t)
        tensor.name = node.output[0]
        model.graph.node.remove(node)


def prune(model) -> None:
    """Remove the nodes whose outputs nothing reads, then the initializers and inputs that nothing
    reads and the value infos of values that no node makes (or that are outputs)."""
    needed = {value.name for value in model.graph.output}
    kept = []
    for node in reversed(model.graph.node):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed |= reads(node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(kept))
    described = {name for node in model.graph.node for name in node.output} - \
        {value.name for value in model.graph.output}
    for field, keep in ((model.graph.initializer, needed), (model.graph.input, needed),
                        (model.graph.value_info, described)):
        for entry in [entry for entry in field if entry.name not in keep]:
            field.remove(entry)


def add_weights(model, weights: Mapping, path: Path, name: Path) -> None:
    """Each input of `model` named in `weights` (name -> array) made an initializer holding it,
    after `prune`: in the graph, or where they total more than external_data.threshold() bytes,
    each of external_data.INLINE_BYTES or more in `data_file(name)` beside `path` (the model's
    file, renamed to `name` when it is complete), written there before the next is read."""
    prune(model)
    store_weights(model, weights, path, name)


def store_weights(model, weights: Mapping, path: Path, name: Path) -> None:
    """add_weights without the pruning: each input of `model` named in `weights` an initializer,
    in the graph or in external data beside `path`, one tensor in memory at a time."""
    from onnx import numpy_helper
    from onnx.external_data_helper import save_external_data, set_external_data

    graph = model.graph
    parameters = [value for value in graph.input if value.name in weights]
    data = Path(path).with_name(external_data.data_file(name).name)
    data.unlink(missing_ok=True)  # onnx appends to the file
    outside = external_data.initializer_bytes(model) + sum(weights[v.name].nbytes for v in parameters) > \
        external_data.threshold()
    for value in parameters:
        tensor = numpy_helper.from_array(weights[value.name], value.name)
        if outside and len(tensor.raw_data) >= external_data.INLINE_BYTES:
            set_external_data(tensor, data.name)
            save_external_data(tensor, str(data.parent))
            # Cleared before the graph copies it in: its bytes are never in the model's memory.
            tensor.ClearField("raw_data")
        graph.initializer.append(tensor)
    for value in parameters:
        graph.input.remove(value)
