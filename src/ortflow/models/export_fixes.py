"""Gaps in torch.onnx's TorchScript exporter (torch 2.13, opset 16) that stop
Hugging Face transformers models with their default attention (sdpa) from
training, found by exporting GPT-2 and BERT and reading the graphs:

1. `aten::diff` has no symbolic at any opset. transformers' mask code
   (`masking_utils.find_packed_sequence_indices`) calls `torch.diff` on the
   position ids whenever a model runs without a cache and without an attention
   mask, i.e. in training. `_diff` adds one: Slice minus Slice.
2. The same code then takes `(diff != 1).cumsum(-1)`; torch's `aten::cumsum`
   symbolic writes CumSum on the bool tensor, which ONNX's CumSum does not
   take. `_cumsum` first casts integral and bool inputs to int64, as torch does.
3. torch's symbolic for `aten::scaled_dot_product_attention` writes the
   attention's dropout as `Dropout(weights, ratio)`: no `training_mode` input,
   so ONNX runs it as the identity, and no mask output, which ONNX Runtime's
   Dropout gradient reads (the `i < node_->OutputDefs().size()` assertion).
   `give_dropout_its_mask` rewrites it as torch's own `aten::dropout` symbolic
   writes a training-mode dropout: `Dropout(weights, ratio, True) -> (y, mask)`.
   ONNX Runtime's eval graph then turns it off like every other Dropout.

And one gap for every torch module with token ids, found by training
nn.Embedding(padding_idx=0) against torch (tests/test_torch_layers.py):

4. torch's `aten::embedding` symbolic writes a bare Gather (with a warning that
   ONNX cannot keep the padding row from updating), so ONNX Runtime trains the
   padding row that torch never updates from the lookup, and the two trainings
   part at the second step. ONNX has no stop-gradient to keep the row's value in
   the forward and drop the lookup's gradient into it (masking the gathered rows
   to zero, as ortflow did, changes the outputs wherever the row is not zero: a
   model whose output layer is its embedding trains that row). So the forward
   stays the bare Gather, torch's values, and the gradient is fixed where ONNX
   Runtime writes it: `mark_padding_rows` records in the exported model which
   Gathers look up an nn.Embedding with a padding_idx, and after the training
   graph is generated `keep_padding_rows` zeroes, before each such Gather's
   GatherGrad, the incoming gradient at the padding positions, which is what
   torch's embedding backward does.

And one for any module that stays in eval mode while it is exported (one whose
`train()` keeps it there; torch.onnx asks for training mode, not more):

5. torch.onnx's initializer deduplication then merges parameters and buffers
   of equal value, not only those that share memory: in a fresh module two
   BatchNorms' weights (ones) and biases (zeros), or two zero Linear biases,
   become one initializer, the others an Identity of it, and would train as
   one. `untie_initializers` gives each its own initializer again.

And one in ONNX Runtime's gradient builder, found by training Falcon with
multi-query attention (one key/value head, broadcast against the query heads):

6. The builder sums a broadcast input's gradient over the broadcast dimensions
   only where the graph records both inputs' shapes; ONNX's own shape inference
   loses them at the Reshapes of a shape computed at run time, so the gradient
   of Falcon's `query * key` keeps 4 heads where the key has 1 ("Shape mismatch
   attempting to re-use buffer"). `infer_shapes` writes every value's shape
   with ONNX Runtime's symbolic shape inference (symbols for the batch and
   whatever follows from it) before the training graphs are generated.

"""

from __future__ import annotations

import logging
import re

from ..errors import ModelError
from . import is_float

log = logging.getLogger("ortflow.build_artifacts")


def _diff(g, input, n, dim, prepend, append):
    """torch.diff(input, n, dim, prepend, append) as Concat, Slice and Sub (Xor for bool)."""
    import torch
    from torch.onnx import symbolic_helper

    n, dim = symbolic_helper._get_const(n, "i", "n"), symbolic_helper._get_const(dim, "i", "dim")
    parts = [p for p in (prepend, input, append) if not symbolic_helper._is_none(p)]
    x = g.op("Concat", *parts, axis_i=dim) if len(parts) > 1 else input
    boolean = symbolic_helper._is_bool(input)

    def constant(values):
        return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

    for _ in range(n):
        later = g.op("Slice", x, constant([1]), constant([torch.iinfo(torch.int64).max]), constant([dim]))
        earlier = g.op("Slice", x, constant([0]), constant([-1]), constant([dim]))
        x = g.op("Xor" if boolean else "Sub", later, earlier)
    return x


def _cumsum(g, input, dim, dtype):
    """torch.cumsum: with the dtype asked for, else int64 for integral and bool inputs."""
    import onnx
    import torch
    from torch.onnx import symbolic_helper

    dim = symbolic_helper._get_const(dim, "i", "dim")
    if not symbolic_helper._is_none(dtype):
        scalar_type = symbolic_helper._get_const(dtype, "i", "dtype")
        input = g.op("Cast", input, to_i=symbolic_helper.scalar_type_to_onnx[scalar_type])
    elif not symbolic_helper._is_fp(input):
        input = g.op("Cast", input, to_i=onnx.TensorProto.INT64)
    return g.op("CumSum", input, g.op("Constant", value_t=torch.tensor(dim, dtype=torch.int64)))


def _embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse):
    """torch.nn.functional.embedding: a Gather, without torch's warning about padding_idx (whose
    row `keep_padding_rows` keeps from the lookup's gradient)."""
    from torch.onnx import symbolic_helper
    from torch.onnx.errors import SymbolicValueError

    if symbolic_helper._get_const(scale_grad_by_freq, "b", "scale_grad_by_freq"):
        raise SymbolicValueError("embedding with scale_grad_by_freq=True: ONNX cannot scale the gradients by the "
                                 "tokens' frequency; set scale_grad_by_freq=False", weight)
    return g.op("Gather", weight, indices)


def check_embeddings(module) -> None:
    """Refuse an nn.Embedding that cannot train in ONNX as in torch, naming it."""
    import torch

    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.Embedding) and layer.scale_grad_by_freq:
            raise ModelError(f"model.path: {type(module).__name__}.{name} (nn.Embedding) has scale_grad_by_freq=True, "
                             "which ONNX cannot express (it scales each token's gradient by its frequency in the "
                             "batch); set scale_grad_by_freq=False")


# The exported model's metadata property that lists its padding lookups: {Gather output: padding_idx}.
PADDING_ROWS = "ortflow.padding_rows"


def mark_padding_rows(model, module) -> dict[str, int]:
    """Record in `model`'s metadata (PADDING_ROWS) each Gather that reads the weight of an
    nn.Embedding of the torch `module` that has a padding_idx (an embedding tied to an output
    layer is one initializer, read by the lookups and the layer's Transpose or MatMul alike).
    Returns what it recorded."""
    import json

    import torch

    padding = {layer.weight.data_ptr(): layer.padding_idx for layer in module.modules()
               if isinstance(layer, torch.nn.Embedding) and layer.padding_idx is not None}
    weights = {name: padding[tensor.data_ptr()] for name, tensor in module.named_parameters(remove_duplicate=False)
               if tensor.data_ptr() in padding}
    rows = {node.output[0]: weights[node.input[0]] for node in model.graph.node
            if node.op_type == "Gather" and node.input[0] in weights}
    if rows:
        model.metadata_props.add(key=PADDING_ROWS, value=json.dumps(rows, sort_keys=True))
    return rows


def keep_padding_rows(artifacts) -> int:
    """In ONNX Runtime's training graph (`artifacts`: generate_artifacts' output), give each
    lookup marked by mark_padding_rows the gradient torch's embedding gives: none into the
    padding row. ONNX Runtime's gradient of `Gather(weight, ids) -> rows` is
    `GatherGrad(Shape(weight), ids, rows_grad)`, which adds each position's gradient into its
    token's row: the positions of the padding token are zeroed first. The mark, which both
    graphs inherit from the exported model, is removed from them (the exported model is written
    from the eval graph). Returns how many GatherGrads were changed."""
    import json

    import numpy as np
    import onnx

    graphs = {path: onnx.load(str(path), load_external_data=False)
              for path in (artifacts.training_model, artifacts.eval_model)}
    marks = {path: [p for p in model.metadata_props if p.key == PADDING_ROWS] for path, model in graphs.items()}
    if not any(marks.values()):
        return 0
    training = graphs[artifacts.training_model]
    rows = json.loads(marks[artifacts.training_model][0].value)
    gradients = {f"{output}_grad": padding for output, padding in rows.items()}
    nodes, changed = [], 0
    for node in training.graph.node:
        padding = gradients.get(node.input[2]) if node.op_type == "GatherGrad" and len(node.input) == 3 else None
        if padding is not None:
            ids, gradient, prefix = node.input[1], node.input[2], f"{node.name or node.output[0]}/padding_row"
            nodes += [
                onnx.helper.make_node("Constant", [], [f"{prefix}/index"],
                                      value=onnx.numpy_helper.from_array(np.array(padding, dtype=np.int64))),
                onnx.helper.make_node("Cast", [ids], [f"{prefix}/ids"], to=onnx.TensorProto.INT64),
                onnx.helper.make_node("Equal", [f"{prefix}/ids", f"{prefix}/index"], [f"{prefix}/is_padding"]),
                onnx.helper.make_node("Constant", [], [f"{prefix}/last"],
                                      value=onnx.numpy_helper.from_array(np.array([-1], dtype=np.int64))),
                onnx.helper.make_node("Unsqueeze", [f"{prefix}/is_padding", f"{prefix}/last"], [f"{prefix}/where"]),
                onnx.helper.make_node("Constant", [], [f"{prefix}/zero"],
                                      value=onnx.numpy_helper.from_array(np.array(0, dtype=np.float32))),
                # in the gradient's type (float16, double); these nodes take no gradient themselves
                onnx.helper.make_node("CastLike", [f"{prefix}/zero", gradient], [f"{prefix}/typed_zero"]),
                onnx.helper.make_node("Where", [f"{prefix}/where", f"{prefix}/typed_zero", gradient],
                                      [f"{prefix}/grad"]),
            ]
            node.input[2] = f"{prefix}/grad"
            changed += 1
        nodes.append(node)
    del training.graph.node[:]
    training.graph.node.extend(nodes)
    for path, model in graphs.items():
        for mark in marks[path]:
            model.metadata_props.remove(mark)
        onnx.save(model, str(path))
    return changed


def register_symbolics(opset: int) -> None:
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic("aten::diff", _diff, opset)
    register_custom_op_symbolic("aten::cumsum", _cumsum, opset)
    register_custom_op_symbolic("aten::embedding", _embedding, opset)


def give_dropout_its_mask(model) -> int:
    """Give every Dropout without a mask output (torch's sdpa symbolic writes
    them) a mask output and, if it has none, a training_mode input of True: the
    model was exported in training mode, so a Dropout is meant to drop. Returns
    how many Dropouts were changed."""
    import numpy as np
    import onnx

    fixed = 0
    for node in model.graph.node:
        if node.op_type != "Dropout" or (len(node.output) > 1 and node.output[1]):
            continue
        inputs = list(node.input) + [""] * (3 - len(node.input))
        if not inputs[2]:
            inputs[2] = f"{node.output[0]}_training_mode"
            model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), inputs[2]))
        del node.input[:]
        node.input.extend(inputs)
        del node.output[1:]
        node.output.append(f"{node.output[0]}_mask")
        fixed += 1
    return fixed


def untie_initializers(model, module) -> list[str]:
    """Give each parameter and buffer of the torch `module` that the export merged
    into another of equal value (an `Identity` of the initializer kept) its own
    initializer again, with its value; one shared on purpose (the same memory,
    e.g. a head tied to the embedding) stays shared. Returns the names untied."""
    from onnx import numpy_helper

    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    initializers = {t.name for t in model.graph.initializer}

    def merged(node) -> bool:
        if node.op_type != "Identity" or node.output[0] not in tensors or node.input[0] not in initializers:
            return False
        kept = tensors.get(node.input[0])
        return kept is None or kept.data_ptr() != tensors[node.output[0]].data_ptr()

    untied = [node.output[0] for node in model.graph.node if merged(node)]
    nodes = [node for node in model.graph.node if not merged(node)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(numpy_helper.from_array(tensors[name].detach().cpu().numpy(), name)
                                   for name in untied)
    return untied


def symbolic_shape_inference(model):
    """ONNX Runtime's symbolic shape inference of `model`, in a scratch folder: where it
    cannot infer every shape, it saves the model into the working folder (the user's:
    sym_shape_infer_temp.onnx and a data file) before it raises."""
    import contextlib
    import tempfile

    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    with tempfile.TemporaryDirectory(prefix="ortflow-shapes-") as scratch, contextlib.chdir(scratch):
        return SymbolicShapeInference.infer_shapes(model, auto_merge=True)


def infer_shapes(model) -> None:
    """Write into `model` the shape of every value that ONNX Runtime's symbolic shape
    inference finds; nothing where it fails (a help to the gradient builder, which works
    without it for most models). The inference copies the model it is given: it is given
    the graph with the float initializers (the weights) as inputs of their shapes, since it
    reads the values of integer initializers only."""
    import onnx

    graph = model.graph
    weights = [onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in graph.initializer if is_float(t)]
    light = onnx.helper.make_model(
        onnx.helper.make_graph(graph.node, graph.name, [*graph.input, *weights], graph.output,
                               [t for t in graph.initializer if not is_float(t)]),
        opset_imports=model.opset_import, ir_version=model.ir_version, functions=model.functions)
    try:
        inferred = symbolic_shape_inference(light)
    except Exception as error:  # noqa: BLE001 - it fails in many ways on models it does not cover
        log.warning("model.path: ONNX Runtime's symbolic shape inference failed (%s: %s); the training graphs are "
                    "built without the shapes it finds", type(error).__name__, str(error).strip()[:200])
        return
    del graph.value_info[:]
    graph.value_info.extend(inferred.graph.value_info)


def unsupported_operator(error: Exception, module: str, opset: int) -> ModelError:
    """One line for an operator that torch.onnx cannot export (its own message
    ends in a dump of the traced graph)."""
    match = re.search(r"operator '([^']+)'", str(error))
    operator = match.group(1) if match else str(error).splitlines()[0]
    return ModelError(
        f"model.path: torch.onnx cannot export operator {operator} of {module} at ONNX opset {opset}; "
        "compute it with other torch operations, register a symbolic for it "
        "(torch.onnx.register_custom_op_symbolic in the model's module), or export the model yourself and use model.kind: onnx"
    )
