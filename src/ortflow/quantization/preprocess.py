"""ONNX Runtime's quantization pre-processing (`quant_pre_process`: symbolic shape inference,
ONNX Runtime's basic graph optimizations, ONNX's shape inference), which runs before the
model is quantized, with its weights in their file and the transposed weights that its
optimizations would fold folded here first, one at a time. Where its shape inference cannot
run on a model, it is skipped with a warning, and at worst the model is quantized as it is.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from pathlib import Path

from .. import external_data
from ..onnx_nodes import attributes

log = logging.getLogger("ortflow.quantize")

# The data file of the weights that fold_transposed_weights transposes, beside the steps' files.
FOLDED = "folded.onnx.data"


def preprocess(source: Path, target: Path) -> None:
    """ONNX Runtime's quantization pre-processing (`quant_pre_process`: symbolic shape
    inference, ONNX Runtime's basic graph optimizations, ONNX's shape inference); where its
    symbolic shape inference cannot run (it raises TypeError on inputs of unknown shape, as
    some exports at newer opsets have), without it, and at worst the model as it is."""
    attempts = [{}, {"skip_symbolic_shape": True}, {"skip_symbolic_shape": True, "skip_onnx_shape": True}]
    for skip in attempts:
        try:
            pre_process(source, target, **skip)
            return
        except Exception as error:  # ORT's pre-processing fails in many ways; quantization works without it
            log.warning("quantization pre-processing%s failed on %s (%s: %s); retrying without %s",
                        f" ({', '.join(skip)})" if skip else "", source, type(error).__name__,
                        str(error).strip()[:200], "shape inference" if skip else "symbolic shape inference")
    # As it is, with its external data copied under the name the copy's tensors give it.
    external_data.save_model(external_data.load_model(source), target)


def pre_process(source: Path, target: Path, skip_symbolic_shape: bool = False, skip_onnx_shape: bool = False) -> None:
    """The steps of ONNX Runtime's `quant_pre_process`, each on a file whose weights stay in
    its external data: `quant_pre_process` reads the weights whole and holds them through
    every step (on a GPT of 86M parameters, 7.5 times their size at its peak). The steps'
    files go beside `target` with the source's data file linked there (no copy), since
    ONNX Runtime and ONNX find a model's external data beside it."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization.quant_utils import add_pre_process_metadata
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    folder = target.parent
    step, optimized = folder / "pre-process.onnx", folder / "optimized.onnx"
    linked = folder / external_data.data_file(source).name  # where `step`'s tensors find their data
    if external_data.data_file(source).is_file():
        linked.unlink(missing_ok=True)
        os.link(external_data.data_file(source), linked)
    graph = external_data.load_model(source, load_data=False)
    if not skip_symbolic_shape:
        with contextlib.chdir(source.parent):  # where it finds the data of a tensor whose value it reads
            graph = SymbolicShapeInference.infer_shapes(graph)
    fold_transposed_weights(graph, source.parent, folder / FOLDED)
    onnx.save(graph, str(step))
    del graph
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(optimized)
    # Not its warning for each weight that fold_transposed_weights left unread, which it drops (it
    # drops them silently after its own folding).
    options.log_severity_level = 3
    # The session only writes the optimized model: no packed copy of the MatMul weights for running it.
    options.add_session_config_entry("session.disable_prepacking", "1")
    if is_external(source):
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         external_data.data_file(optimized).name)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                         str(external_data.INLINE_BYTES))
    ort.InferenceSession(str(step), options, providers=["CPUExecutionProvider"])  # writes `optimized`
    if not skip_onnx_shape:
        onnx.shape_inference.infer_shapes_path(str(optimized), str(optimized))
    graph = external_data.load_model(optimized, load_data=False)
    add_pre_process_metadata(graph)
    external_data.save_graph(graph, optimized, target)
    for scratch in (step, optimized, linked, folder / FOLDED):
        scratch.unlink(missing_ok=True)


def is_external(model: Path) -> bool:
    """Whether the model keeps its weights in external data (the exported model over external_data.threshold())."""
    return external_data.uses_external_data(external_data.load_model(model, load_data=False))


def fold_transposed_weights(graph, source_folder: Path, data: Path) -> None:
    """Fold each Transpose of a weight into that weight transposed, one tensor at a time, as
    ONNX Runtime's constant folding would: torch exports a Linear whose parameters are graph
    inputs (models/torch_export.py) as MatMul(x, Transpose(weight)), and ONNX Runtime's
    session, folding them all, held every transposed weight beside its graph while it wrote
    them out (3.2 times the weights of a 554M GPT at its peak). The result is an initializer
    named for the Transpose's output, as ONNX Runtime names it. A weight no node reads any more
    is left for ONNX Runtime to drop, as after its own folding: dropped here, the initializers
    ONNX Runtime keeps would come in another order, and its constant sharing would keep another
    of two equal constants. Transposed weights of a model in external data go to `data` (read
    from `source_folder`, one at a time); the others stay in the graph."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data as uses

    initializers = {tensor.name: tensor for tensor in graph.graph.initializer}
    # Initializers that are also graph inputs can be fed another value: ONNX Runtime folds none of them.
    overridable = {value.name for value in graph.graph.input}
    outputs = {value.name for value in graph.graph.output}
    # A weight two Transposes read is left to ONNX Runtime, whose common subexpression elimination
    # makes the two one before it folds them.
    transposes = collections.Counter(node.input[0] for node in graph.graph.node if node.op_type == "Transpose")
    folded, kept = [], []
    with open(data, "wb") as file:
        for node in graph.graph.node:
            weight = initializers.get(node.input[0]) if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") \
                else None
            if weight is None or weight.name in overridable or node.output[0] in outputs or \
                    transposes[weight.name] > 1 or weight.data_type == onnx.TensorProto.STRING:
                kept.append(node)
                continue
            # A copy reads the bytes: to_array leaves them in the tensor it reads (external_data.weights_as_inputs).
            alone = onnx.TensorProto()
            alone.CopyFrom(weight)
            array = numpy_helper.to_array(alone, str(source_folder))
            del alone
            perm = attributes(node).get("perm") or list(reversed(range(array.ndim)))
            transposed = np.ascontiguousarray(array.transpose(perm))
            del array
            if uses(weight):
                tensor = onnx.TensorProto(name=node.output[0], data_type=weight.data_type, dims=transposed.shape)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", data.name), ("offset", file.tell()), ("length", transposed.nbytes)):
                    tensor.external_data.add(key=key, value=str(value))
                file.write(transposed.data)
            else:
                tensor = numpy_helper.from_array(transposed, node.output[0])
            del transposed
            folded.append(tensor)
    if not folded:
        return
    log.info("folded %d Transpose(s) of weights before ONNX Runtime's optimization", len(folded))
    del graph.graph.node[:]
    graph.graph.node.extend(kept)
    graph.graph.initializer.extend(folded)
