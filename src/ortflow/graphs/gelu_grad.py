"""The gradient of GELU's tanh approximation (GPT-2's "gelu_new") in ONNX's own element-wise
operators, for float32 training graphs.

ONNX Runtime's gradient builder writes com.microsoft's FastGeluGrad for a FastGelu, and 1.19.2's
CPU kernel of it is not vectorized: 37.7 ms on [512, 3072] on one thread (Intel Xeon), where the
15 nodes below take 8.7 ms; 12 of them make a GPT-2 124M step at fp32 1.10x faster
(docs/benchmarks.md, "The tanh GELU's gradient"). The nodes compute the same function in float32, its values within float32's rounding
of the kernel's (tests/test_gelu_grad.py). At train.precision bf16 ortflow's operator takes the
node instead (ATen's kernel, graphs/precision.py), whose library such graphs load anyway.

With t = tanh(u), u = x (k + k a x^2), k = sqrt(2 / pi), a = 0.044715, as FastGelu's y = x (1 + t) / 2:
    dX = dY (1 + t + x (1 - t^2) (k + 3 k a x^2)) / 2
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

OP, DOMAIN = "FastGeluGrad", "com.microsoft"
K, A = math.sqrt(2 / math.pi), 0.044715
# Constant name -> value, one Constant node each for the whole graph.
CONSTANTS = {"k": K, "ka": K * A, "three": 3.0, "one": 1.0, "half": 0.5}
PREFIX = "ortflow.gelu_grad"


def steps(dy: str, x: str, dx: str) -> list[tuple[str, list[str], str]]:
    """(operator, inputs, output) of the nodes computing dX from dY and X, in order; intermediate
    values are named after `dx`."""
    c = {name: f"{PREFIX}.{name}" for name in CONSTANTS}
    v = {name: f"{dx}.gelu_grad.{name}" for name in (
        "x2", "kax2", "slope", "u", "t", "kax2_3", "du", "t2", "sech2", "sech2_du", "x_sech2_du", "t_plus", "twice", "grad")}
    return [
        ("Mul", [x, x], v["x2"]),
        ("Mul", [v["x2"], c["ka"]], v["kax2"]),
        ("Add", [v["kax2"], c["k"]], v["slope"]),  # k + k a x^2
        ("Mul", [x, v["slope"]], v["u"]),
        ("Tanh", [v["u"]], v["t"]),
        ("Mul", [v["kax2"], c["three"]], v["kax2_3"]),
        ("Add", [v["kax2_3"], c["k"]], v["du"]),  # du/dx = k + 3 k a x^2
        ("Mul", [v["t"], v["t"]], v["t2"]),
        ("Sub", [c["one"], v["t2"]], v["sech2"]),
        ("Mul", [v["sech2"], v["du"]], v["sech2_du"]),
        ("Mul", [x, v["sech2_du"]], v["x_sech2_du"]),
        ("Add", [v["x_sech2_du"], v["t"]], v["t_plus"]),
        ("Add", [v["t_plus"], c["one"]], v["twice"]),  # twice dGELU/dx
        ("Mul", [v["twice"], c["half"]], v["grad"]),
        ("Mul", [dy, v["grad"]], dx),
    ]


def mentioned(path: Path) -> bool:
    """Whether the model file at `path` may hold a FastGeluGrad: an operator's name is stored as
    its bytes, so a graph without them has none, found without parsing a graph whose weights
    (GPT-2 124M: 500 MB) it may hold."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(OP.encode()) >= 0


def is_kernel(node) -> bool:
    """Whether `node` is ONNX Runtime's com.microsoft FastGeluGrad."""
    return node.op_type == OP and node.domain == DOMAIN


def decompose(model) -> int:
    """Replace each com.microsoft FastGeluGrad of `model`'s graph (inputs dY, X) with `steps`' nodes,
    in place; returns how many. The nodes keep the replaced node's name as their prefix, which
    train.profile_steps' traces show."""
    from onnx import TensorProto, helper

    graph = model.graph
    replaced = sum(map(is_kernel, graph.node))
    if not replaced:
        return 0
    nodes = [helper.make_node("Constant", [], [f"{PREFIX}.{name}"], name=f"{PREFIX}.{name}",
                              value=helper.make_tensor(f"{PREFIX}.{name}", TensorProto.FLOAT, [], [value]))
             for name, value in CONSTANTS.items()]
    for node in graph.node:
        if is_kernel(node):
            dy, x = node.input
            nodes += [helper.make_node(op, inputs, [output], name=f"{node.name}/{op}_{index}")
                      for index, (op, inputs, output) in enumerate(steps(dy, x, node.output[0]))]
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return replaced
