"""`train.precision: bf16`: the matrix multiplies of the training and eval graphs computed in
bfloat16 with float32 accumulation by ortflow's operator `ortflow.BF16MatMul` (kernels/), as
torch.autocast("cpu", dtype=torch.bfloat16) computes them; every other operator, the weights,
the gradients and the optimizer stay float32, as autocast keeps them.

build_artifacts rewrites the generated graphs (after train.recompute, so that the recomputed
blocks' copies are rewritten too): the float32 `MatMul`s (2-D or batched), the `Gemm`s
whose alpha is 1 (with a bias C and beta 1, as BF16MatMul + Add), and com.microsoft's
`FusedMatMul`s (ONNX Runtime's gradient builder writes them for the backward's transposed
products) whose alpha is 1 and that transpose no batch axes; anything else stays as it is.
A Transpose that swaps the last two axes of a multiply's input, and whose output only such
multiplies read, becomes their transA/transB, as ONNX Runtime's own fusion makes it part of a
Gemm or FusedMatMul in a float32 graph: left as a node, it would copy the tensor, and a copy of a
weight lives from the forward to the backward (BERT-base: 72 of them, 367 MiB a rank).
com.microsoft's FastGeluGrad (the gradient of GPT-2's tanh GELU) becomes ortflow's, the same
function by ATen's vectorized kernel: ONNX Runtime's took 0.35 s of a GPT-2 124M step. (At fp32,
apply writes it as ONNX's element-wise operators instead, gelu_grad.py: fp32 graphs load no
library of ortflow's.)
The training graph is rewritten in place; the eval graph is written rewritten beside the
float32 one (`Artifacts.eval_model_bf16`), which export reads, so the exported model is
float32 as trained and is checked against a float32 eval graph.

A Module opened on such artifacts (`module_graphs`) registers the operator's library and
sets ATen's intra-op threads, which run its product (not ONNX Runtime's pool)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..artifacts import Artifacts
from ..onnx_nodes import attributes
from . import gelu_grad

log = logging.getLogger("ortflow.build_artifacts")

OP, DOMAIN = "BF16MatMul", "ortflow"
MICROSOFT = "com.microsoft"
# What Gemm's output is called before its bias is added, where BF16MatMul + Add replaces it.
UNBIASED = "_bf16_unbiased"


def biased(node) -> bool:
    """A Gemm with its C input."""
    return node.op_type == "Gemm" and len(node.input) > 2 and bool(node.input[2])


def replaceable(node) -> bool:
    """Whether `node` is a multiply that BF16MatMul (+ Add) computes as it does (see above)."""
    found = attributes(node)
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        return True
    if node.op_type == "Gemm" and node.domain in ("", "ai.onnx"):
        return found.get("alpha", 1.0) == 1.0 and (not biased(node) or found.get("beta", 1.0) == 1.0)
    if node.op_type == "FusedMatMul" and node.domain == MICROSOFT:
        return found.get("alpha", 1.0) == 1.0 and not found.get("transBatchA") and not found.get("transBatchB")
    return False


def not_float(graph) -> set[str]:
    """The tensors the graph declares of another type than float32 (inputs, initializers, value
    infos). The graphs carry no type for most computed tensors, and ortflow trains float32 models,
    so a multiply is taken as float32 unless an input is declared otherwise (an integer MatMul)."""
    from onnx import TensorProto

    declared = {value.name: value.type.tensor_type.elem_type for value in [*graph.input, *graph.value_info]}
    declared |= {tensor.name: tensor.data_type for tensor in graph.initializer}
    return {name for name, kind in declared.items() if kind not in (TensorProto.FLOAT, TensorProto.UNDEFINED)}


def swaps_last_two(node) -> bool:
    """A Transpose that swaps the last two axes of its input and keeps the others in place."""
    perm = list(attributes(node).get("perm", []))
    return node.op_type == "Transpose" and len(perm) >= 2 and perm == [*range(len(perm) - 2), len(perm) - 1,
                                                                        len(perm) - 2]


def absorbed_transposes(graph, rewritten: set[int]) -> dict:
    """{output: Transpose node} of the Transposes that the multiplies at the positions
    `rewritten` of the graph's nodes take in as transA/transB (see above): each swaps the last
    two axes, and only those multiplies read it."""
    readers: dict[str, set[int]] = {}
    for position, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, set()).add(position)
    outputs = {value.name for value in graph.output}
    return {node.output[0]: node for node in graph.node
            if swaps_last_two(node) and node.output[0] not in outputs and readers.get(node.output[0])
            and readers[node.output[0]] <= rewritten}


def rewrite(model) -> int:
    """Replace the multiplies of `model` that `replaceable` accepts with BF16MatMul, in place,
    with the Transposes they absorb, and FastGeluGrad with ortflow's; returns how many multiplies."""
    from onnx import helper

    graph, others = model.graph, not_float(model.graph)
    rewritten = {position for position, node in enumerate(graph.node)
                 if replaceable(node) and not any(name in others for name in node.input)}
    transposes = absorbed_transposes(graph, rewritten)
    nodes = []
    for position, node in enumerate(graph.node):
        if node.op_type == "Transpose" and node.output[0] in transposes:
            continue
        if gelu_grad.is_kernel(node):
            nodes.append(helper.make_node(node.op_type, node.input, node.output, name=node.name, domain=DOMAIN))
            continue
        if position not in rewritten:
            nodes.append(node)
            continue
        found, inputs = attributes(node), list(node.input[:2])
        trans = {"transA": int(found.get("transA", 0)), "transB": int(found.get("transB", 0))}
        for index, key in enumerate(("transA", "transB")):
            if inputs[index] in transposes:
                inputs[index], trans[key] = transposes[inputs[index]].input[0], 1 - trans[key]
        product = node.output[0] + UNBIASED if biased(node) else node.output[0]
        # The node keeps its name: train.profile_steps' traces name nodes by it.
        nodes.append(helper.make_node(OP, inputs, [product], name=node.name, domain=DOMAIN, **trans))
        if biased(node):
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
    del graph.node[:]
    graph.node.extend(nodes)
    # Any ortflow node needs the domain's opset, a FastGeluGrad in a graph without a multiply too.
    if any(node.domain == DOMAIN for node in nodes) and all(opset.domain != DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(rewritten)


def apply(folder: Path, precision: str) -> dict[str, int]:
    """With `precision` bf16, rewrite the training graph of the artifacts in `folder` in place and
    write its eval graph rewritten to `Artifacts.eval_model_bf16` (the float32 one stays, for
    export). Returns the count of multiplies rewritten in each ({} for fp32). Where neither graph
    has one, nothing is written, and the artifacts train in float32 (`Artifacts.bf16` is False).
    At fp32 the training graph's FastGeluGrads become ONNX's element-wise operators (gelu_grad.py)."""
    import onnx

    files = Artifacts(folder)
    if precision != "bf16":
        if not gelu_grad.mentioned(files.training_model):
            return {}  # most models: their graph is not parsed again
        training = onnx.load(str(files.training_model), load_external_data=False)
        decomposed = gelu_grad.decompose(training)
        if decomposed:
            onnx.save(training, str(files.training_model))
            log.info("%d FastGeluGrad(s) of the training graph as ONNX element-wise operators (ONNX Runtime's "
                     "kernel is not vectorized)", decomposed)
        return {}
    # Without the weights: a graph over external_data.threshold() keeps pointing at its data file beside it.
    models = {"training": onnx.load(str(files.training_model), load_external_data=False),
              "eval": onnx.load(str(files.eval_model), load_external_data=False)}
    counts = {name: rewrite(model) for name, model in models.items()}
    # Both or neither: the eval graph's file is what tells training to register the operator.
    if any(counts.values()):
        onnx.save(models["training"], str(files.training_model))
        onnx.save(models["eval"], str(files.eval_model_bf16))
    return counts


def module_graphs(files: Artifacts, options, threads: int | None = None) -> tuple[str, str]:
    """(training graph, eval graph) for a Module opened with `options`. With artifacts built at
    bf16, the eval graph is the rewritten one, `options` load ortflow's operators (kernels/), and
    ATen runs its products on `threads` (the rank's share of the cores; ATen's pool, not ONNX
    Runtime's, which `options` size, computes them: left at ATen's default, a thread per core,
    ranks sharing a node's cores would each take all of them)."""
    if not files.bf16:
        return str(files.training_model), str(files.eval_model)
    import torch

    from .. import kernels

    options.register_custom_ops_library(str(kernels.library()))
    if threads:
        torch.set_num_threads(threads)
    return str(files.training_model), str(files.eval_model_bf16)
