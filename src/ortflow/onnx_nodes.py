"""Reading an ONNX node: its attributes by name, and the values it reads (its subgraphs' too)."""

from __future__ import annotations


def attributes(node) -> dict:
    """{name: value} of the attributes `node` carries (ints, floats, strings, lists, tensors and
    graphs as onnx.helper.get_attribute_value gives them); one it leaves out takes the operator's
    default, which the caller names with `.get(name, default)`."""
    from onnx import helper

    return {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}


def reads(node) -> set[str]:
    """The values `node` reads: its inputs, and the outer values its subgraphs (If, Loop, Scan) read."""
    names = set(node.input)
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.HasField("g") else attribute.graphs:
            for inner in graph.node:
                names |= reads(inner)
    return names
