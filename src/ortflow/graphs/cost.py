"""What a sample costs the forward model: FLOPs, the activations training keeps for the
backward pass, and the most an evaluation holds at once (model.json, read by
preflight's memory estimate)."""

from __future__ import annotations

import logging
import math

from ..data.manifest import Manifest
from ..models import is_float
from ..models.export_fixes import symbolic_shape_inference
from ..models.torch_export import sequence_features, sequence_name
from ..onnx_nodes import attributes

log = logging.getLogger("ortflow.build_artifacts")


def per_sample_values(base, manifest: Manifest) -> dict[str, tuple[list[int], int]]:
    """Name -> (shape, bytes per element) of every value of the forward model whose
    shape is known for a batch of one sample of the data of `manifest` (a text model's
    dynamic sequence dimension at the data's length). ONNX Runtime's symbolic shape
    inference follows shapes through Shape, Gather, Concat and Reshape, which torch's
    exporter emits around transformers' Conv1D (a Gemm on the flattened batch) and
    attention (MatMuls of [batch, heads, time, head]); ONNX's own inference loses them there."""
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(base)
    del model.graph.value_info[:]
    initializers = {t.name for t in model.graph.initializer}
    # A dimension named like the sequence's has the length of the data's text (models/torch_export.py).
    lengths = {"batch": 1} | {sequence_name(f.name): f.shape[0] for f in manifest.features
                              if f.name in sequence_features(manifest, manifest.features)}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name not in initializers and value.type.tensor_type.shape.dim:
            value.type.tensor_type.shape.dim[0].dim_param = "batch"
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param in lengths:
                    dim.dim_value = lengths[dim.dim_param]
    # The float initializers as graph inputs of their shapes, which is all shape inference needs
    # of them: their values are gone once the checkpoint holds them (drop_weights), and symbolic
    # shape inference would read the empty tensors (BERT: "cannot reshape array of size 0").
    weights = [t for t in model.graph.initializer if is_float(t)]
    kept = [t for t in model.graph.initializer if not is_float(t)]
    inputs = {value.name for value in model.graph.input}
    model.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in weights if t.name not in inputs)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    try:
        model = symbolic_shape_inference(model)
    except Exception as error:  # an operator it does not know: ONNX's inference, which gives up more often
        log.warning("symbolic shape inference failed (%s); counting FLOPs from ONNX's shape inference", error)
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    values = {t.name: (list(t.dims), onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize)
              for t in model.graph.initializer}
    for value in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        tensor = value.type.tensor_type
        # A value whose shape inference could not tell has no shape at all (not that of a scalar).
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim) and tensor.elem_type:
            values[value.name] = ([d.dim_value for d in tensor.shape.dim],
                                  onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize)
    return values


def forward_flops(base, values: dict) -> int:
    """Multiply-adds x 2 of MatMul, Gemm and Conv for one sample, from `per_sample_values`."""
    return sum(node_flops(base.graph.node, values).values())


def node_flops(nodes, values: dict) -> dict[int, int]:
    """Index in `nodes` -> multiply-adds x 2 for one sample of each MatMul, Gemm and Conv
    whose shapes `per_sample_values` knows (the others are named in a warning)."""
    flops, unknown = {}, []
    for index, node in enumerate(nodes):
        if node.op_type not in ("MatMul", "Gemm", "Conv"):
            continue
        a, b, y = (values[name][0] if name in values else None for name in (node.input[0], node.input[1], node.output[0]))
        if a is None or b is None or y is None:
            unknown.append(node.name or node.op_type)
        elif node.op_type == "Conv":
            flops[index] = 2 * math.prod(y) * math.prod(b[1:])
        elif node.op_type == "Gemm":
            flops[index] = 2 * math.prod(y) * (a[0] if attributes(node).get("transA", 0) else a[-1])
        else:
            flops[index] = 2 * math.prod(y) * a[-1]
    if unknown:
        log.warning("FLOPs leave out %d node(s) whose shapes are not static: %s", len(unknown), unknown[:5])
    return flops


def batch_values(base, values: dict) -> dict[str, int]:
    """Name -> bytes for one sample of each value the forward pass computes that grows with
    the batch: the outputs of the nodes that read the graph's inputs or values computed
    from them (`per_sample_values` gives their shapes). A value computed from weights
    alone (a tied embedding's transpose, 154 MB in GPT-2) is held once whatever the batch."""
    initializers = {t.name for t in base.graph.initializer}
    grown = {value.name for value in base.graph.input if value.name not in initializers}
    sizes = {}
    for node in base.graph.node:
        if any(name in grown for name in node.input):
            grown.update(node.output)
            sizes.update({name: math.prod(values[name][0]) * values[name][1] for name in node.output if name in values})
    return sizes


def eval_bytes(base, sizes: dict[str, int], logits: str) -> int:
    """Bytes an evaluation holds for one sample beyond the weights: the most the values of
    `batch_values` take at once when the forward pass runs node by node in the graph's
    order (each value from the node that computes it until the last node that reads it,
    the outputs until the end), and the logits once more, for the loss's
    log-probabilities (preflight.memory_estimate)."""
    nodes = [node for node in base.graph.node if node.op_type != "Constant"]
    last_read = {name: index for index, node in enumerate(nodes) for name in node.input}
    last_read.update({output.name: len(nodes) for output in base.graph.output})
    live = peak = 0
    freed_after: dict[int, list[str]] = {}
    for index, node in enumerate(nodes):
        for name in node.output:
            live += sizes.get(name, 0)
            freed_after.setdefault(last_read.get(name, index), []).append(name)
        peak = max(peak, live)
        live -= sum(sizes.get(name, 0) for name in freed_after.pop(index, []))
    return peak + sizes.get(logits, 0)
