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
   padding row that torch never updates, and the two trainings part at the
   second step. `_embedding` multiplies the gathered rows by (ids !=
   padding_idx): the padding row gets a zero gradient, as in torch, and the
   outputs stay torch's because that row is zero (nn.Embedding zeroes it and a
   zero gradient keeps it zero; `check_embeddings` refuses a module whose
   padding row is not zero).

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
    """torch.nn.functional.embedding: Gather, times (indices != padding_idx) when there is a padding_idx."""
    import onnx
    import torch
    from torch.onnx import symbolic_helper
    from torch.onnx.errors import SymbolicValueError

    if symbolic_helper._get_const(scale_grad_by_freq, "b", "scale_grad_by_freq"):
        raise SymbolicValueError("embedding with scale_grad_by_freq=True: ONNX cannot scale the gradients by the "
                                 "tokens' frequency; set scale_grad_by_freq=False", weight)
    rows = g.op("Gather", weight, indices)
    padding_idx = symbolic_helper._get_const(padding_idx, "i", "padding_idx")
    if padding_idx < 0:  # torch's "no padding_idx"; nn.Embedding makes a negative padding_idx positive
        return rows
    index_type = symbolic_helper._try_get_scalar_type(indices)
    index_dtype = index_type.dtype() if index_type else torch.int64
    padding = g.op("Constant", value_t=torch.tensor(padding_idx, dtype=index_dtype))
    keep = g.op("Not", g.op("Equal", indices, padding))
    keep = g.op("Unsqueeze", keep, g.op("Constant", value_t=torch.tensor([-1], dtype=torch.int64)))
    # Cast, not CastLike: ONNX Runtime has no gradient for CastLike.
    weight_type = symbolic_helper._try_get_scalar_type(weight)
    to = weight_type.onnx_type() if weight_type else onnx.TensorProto.FLOAT
    return g.op("Mul", rows, g.op("Cast", keep, to_i=to))


def check_embeddings(module) -> None:
    """Refuse an nn.Embedding that `_embedding` cannot train as torch does, naming it."""
    import torch

    for name, layer in module.named_modules():
        if not isinstance(layer, torch.nn.Embedding):
            continue
        where = f"model.path: {type(module).__name__}.{name} (nn.Embedding)"
        if layer.scale_grad_by_freq:
            raise ModelError(f"{where} has scale_grad_by_freq=True, which ONNX cannot express (it scales each "
                             "token's gradient by its frequency in the batch); set scale_grad_by_freq=False")
        if layer.padding_idx is not None and bool(layer.weight[layer.padding_idx].any()):
            raise ModelError(
                f"{where}: the row of padding_idx {layer.padding_idx} is not zero; ortflow keeps that row from "
                "training by masking it, which needs it zero (as nn.Embedding initialises it): zero it in __init__ "
                f"(with torch.no_grad(): self.{name}.weight[{layer.padding_idx}] = 0) or drop padding_idx"
            )


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
