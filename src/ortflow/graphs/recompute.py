"""Activation recomputation (`train.recompute`), written into the training graph after
`generate_artifacts` has built it, as ONNX Runtime's own memory optimizer does
(`memory_optimizer.cc`, CreateRecomputeGraph). ORT's optimizer itself does nothing for
these graphs: it finds the forward/backward boundary through a YieldOp, which only
ORTModule's graphs have (DESIGN.md, "Facts for memory").

A block is a set of forward nodes (a transformer layer: every node whose name, or
for a fused node its first output's name, lies under a path such as /transformer/h.3/).
Without recomputation the backward reads many tensors computed inside each block, so
they stay alive from the forward until the backward reaches them. With it:
1. the nodes of the block that compute what the backward reads are copied (outputs
   renamed `<name>_recompute`), reading the block's inputs, which stay alive instead;
2. the copies read the block's inputs through `late`, an alias (Reshape to its own
   shape) that waits for a tensor of the backward, so they run when the backward
   reaches the block and not during the forward;
3. the backward reads the copies.
A Dropout is not drawn again: its copy multiplies by the forward's mask (ORT's
DropoutGrad: mask x input / (1 - ratio), what Dropout computed), so the recomputed
values are the forward's bit for bit; the mask, 1 byte an element, is kept.
A block's output that forward nodes outside it read (the next block's input) is
kept: that is the checkpoint the next block recomputes from."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

SUFFIX = "_recompute"
# The gradients' accumulation buffers: every other graph output (loss, logits,
# BatchNorm's running statistics) is computed by the forward.
GRADIENT_OUTPUT = ".accumulation.out"
# A node path's component that numbers a module of a list: h.0, layer.11, blocks.3.
NUMBERED = re.compile(r"\.\d+$")
DROPOUT_OPS = ("Dropout",)
SHAPE_OPS = ("Shape", "Size")


@dataclass
class Block:
    name: str  # the node-name path (/transformer/h.0) or the tensor recomputed alone
    nodes: list = field(default_factory=list)  # forward nodes, in graph order
    recomputed: set = field(default_factory=set)  # tensors the backward reads from copies


def node_key(node) -> str:
    """The module path a node belongs to: its name, which torch.onnx writes as the module path
    (/transformer/h.0/attn/MatMul); ORT's fusions name their nodes otherwise (BiasGelu_token_9)
    but keep the first output's name (/transformer/h.0/mlp/act/Mul_1_output_0)."""
    return node.name if node.name.startswith("/") else (node.output[0] if node.output else "")


def prefixes(key: str) -> list[str]:
    """/a/b.0/c/Op -> [/a, /a/b.0, /a/b.0/c], shortest first."""
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(2, len(parts))]


def forward_nodes(graph) -> list:
    """The nodes the forward outputs (loss, logits, running statistics) depend on, in graph order."""
    producer = {name: node for node in graph.node for name in node.output}
    needed, stack = set(), [o.name for o in graph.output if not o.name.endswith(GRADIENT_OUTPUT)]
    while stack:
        node = producer.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(node.input)
    return [node for node in graph.node if id(node) in needed]


def block_patterns(forward: list) -> list[str]:
    """`train.recompute: blocks`: the list of numbered modules (h.0, h.1, ... under one path)
    that holds the most forward nodes, as one pattern (/transformer/h.*)."""
    counts: dict[str, int] = {}
    for node in forward:
        numbered = next((p for p in prefixes(node_key(node)) if NUMBERED.search(p)), None)
        if numbered:
            family = NUMBERED.sub("", numbered)
            counts[family] = counts.get(family, 0) + 1
    if not counts:
        raise ConfigError("config key 'train.recompute': blocks, but the model's node names show no numbered "
                          "modules (e.g. /transformer/h.0/...); list its blocks' node-name patterns instead")
    return [max(counts, key=counts.get) + ".*"]


def find_blocks(graph, recompute, every_item: bool = True) -> list[Block]:
    """The blocks `recompute` names: `blocks` (found by `block_patterns`), or a list whose
    items are tensor names of the forward (recomputed alone, from their node's inputs) or
    node-name patterns (fnmatch; each distinct shortest path matched is one block).
    An item that matches nothing is refused, unless not `every_item` is asked for."""
    forward = forward_nodes(graph)
    items = block_patterns(forward) if recompute == "blocks" else list(recompute)
    producer = {name: node for node in forward for name in node.output}
    blocks: dict[str, Block] = {}
    used = set()
    for node in forward:
        key = node_key(node)
        for prefix in prefixes(key):
            item = next((p for p in items if p not in producer and fnmatch.fnmatchcase(prefix, p)), None)
            if item:
                used.add(item)
                blocks.setdefault(prefix, Block(prefix)).nodes.append(node)
                break
    for item in items:
        if item in producer:
            used.add(item)
            blocks[item] = Block(item, [producer[item]], {item})
    unmatched = [item for item in items if item not in used]
    if unmatched and every_item:
        raise ConfigError(f"config key 'train.recompute': {unmatched[0]!r} matches no tensor and no node path of "
                          "the training graph's forward (node names are module paths, e.g. /transformer/h.0)")
    return list(blocks.values())


def batch_tensors(graph, forward: list) -> set[str]:
    """The forward's tensors that grow with the batch: the graph inputs of dynamic shape (the
    data; parameters have fixed shapes) and what forward nodes compute from them. Only these
    are worth recomputing (a weight's Transpose is held once whatever the batch)."""
    grown = {value.name for value in graph.input
             if any(not dim.HasField("dim_value") for dim in value.type.tensor_type.shape.dim)}
    for node in forward:
        if any(name in grown for name in node.input):
            grown.update(name for name in node.output if name)
    return grown


def kept_for_backward(graph) -> set[str]:
    """The tensors the forward computes that backward nodes read: what stays alive from the
    forward until the backward (graph inputs and initializers are not counted)."""
    forward = forward_nodes(graph)
    ids = {id(node) for node in forward}
    computed = {name for node in forward for name in node.output if name}
    # A Shape or Size reads no values and runs as soon as its input exists (execution_order
    # PRIORITY_BASED runs them first), so it holds nothing until the backward.
    return {name for node in graph.node if id(node) not in ids and node.op_type not in SHAPE_OPS
            for name in node.input if name in computed}


def apply(path: Path, recompute_config, every_item: bool = True) -> list[Block]:
    """Rewrite the training graph at `path` in place (its external data untouched) so that the
    blocks of `recompute_config` (train.recompute) are recomputed in the backward. Returns the
    blocks ([] for `none`). `every_item` False: a pipeline stage's graph, which holds those of
    the whole model's blocks (their names, `recompute_config`) that lie in it, maybe none."""
    import onnx

    if recompute_config == "none":
        return []
    model = onnx.load(str(path), load_external_data=False)
    blocks = rewrite(model.graph, recompute_config, every_item)
    onnx.save(model, str(path))
    return blocks


def activation_bytes(graph, blocks: list[Block], sizes: dict[str, int]) -> int:
    """Bytes a sample's activations take at most in the rewritten `graph`: those the forward keeps
    for the backward, and the largest block's recomputed tensors, which live while the backward
    goes through that block (`sizes`: cost.batch_values, the forward's tensors by name)."""
    kept = sum(sizes.get(name, 0) for name in kept_for_backward(graph))
    return kept + max(sum(sizes.get(name, 0) for name in block.recomputed) for block in blocks)


def activation_bytes_with_blocks(graph, sizes: dict[str, int]) -> int | None:
    """What `activation_bytes` would give if `graph` (built without recomputation) had its
    blocks recomputed (`train.recompute: blocks`), for the memory estimate's list of fixes;
    None where the model shows no blocks. The rewrite is done on a copy."""
    import onnx

    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    try:
        blocks = rewrite(copy, "blocks")
    except ConfigError:  # no numbered modules in the node names
        return None
    return activation_bytes(copy, blocks, sizes) if blocks else None


def rewrite(graph, recompute_config, every_item: bool = True) -> list[Block]:
    """`recompute` on a loaded graph. Nodes are told apart by id(): `held` keeps every node's
    Python object alive, so protobuf hands out the same object each time."""
    in_order = topological(list(graph.node))
    del graph.node[:]
    graph.node.extend(in_order)
    held = list(graph.node)
    blocks = find_blocks(graph, recompute_config, every_item)
    forward = forward_nodes(graph)
    forward_ids = {id(node) for node in forward}
    backward = [node for node in graph.node if id(node) not in forward_ids]
    read_by_backward = {name for node in backward for name in node.input}
    graph_outputs = {o.name for o in graph.output}
    grown = batch_tensors(graph, forward)
    masks = {node.output[1] for node in forward if node.op_type in DROPOUT_OPS and len(node.output) > 1}
    # (node index, new nodes): each block's copies go just before the first backward node that reads them.
    insertions: list[tuple[int, list]] = []
    order = {id(node): index for index, node in enumerate(graph.node)}
    for block in blocks:
        inside = {id(node) for node in block.nodes}
        if not block.recomputed:
            read_outside = {name for node in forward if id(node) not in inside for name in node.input}
            block.recomputed = {name for node in block.nodes for name in node.output
                                if name in read_by_backward and name in grown and name not in read_outside
                                and name not in graph_outputs and name not in masks}
        if not block.recomputed:
            continue
        # A Shape or Size reads no values, only the shape, the same in the forward's tensor: it
        # keeps reading that (transformers' gradients have Shapes that feed the block's own readers).
        readers = [node for node in backward if node.op_type not in SHAPE_OPS
                   and any(name in block.recomputed for name in node.input)]
        first = min(readers, key=lambda node: order[id(node)])
        trigger = trigger_tensor(graph, first, forward_ids, order)
        copies = copy_block(block, grown, trigger)
        for node in readers:
            for i, name in enumerate(node.input):
                if name in block.recomputed:
                    node.input[i] = name + SUFFIX
        insertions.append((order[id(first)], copies))
    nodes = held
    for index, copies in sorted(insertions, key=lambda item: item[0], reverse=True):
        nodes[index:index] = copies
    del graph.node[:]
    graph.node.extend(nodes)
    return [block for block in blocks if block.recomputed]


def topological(nodes: list) -> list:
    """`nodes` with every node after the nodes that compute its inputs, otherwise in their order:
    generate_artifacts' graphs are not always sorted (transformers' GPT-2 has a gradient's Shape
    last, read by a Reshape before it), and where the copies go relies on the order."""
    producer = {name: node for node in nodes for name in node.output if name}
    placed, out = set(), []
    for start in nodes:
        stack = [(start, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in placed:
                continue
            if ready:
                placed.add(id(node))
                out.append(node)
                continue
            stack.append((node, True))
            stack.extend((producer[name], False) for name in reversed(node.input)
                         if name in producer and id(producer[name]) not in placed)
    return out


def trigger_tensor(graph, first, forward_ids: set, order: dict) -> str:
    """A tensor of the backward that exists just before `first` (the block's first backward
    reader) runs: one of its inputs that the backward computed, else the output of the
    backward node before it in graph order. Every node before `first` in graph order is
    independent of the block's readers, so waiting for it makes no cycle."""
    computed_by_backward = {name: node for node in graph.node if id(node) not in forward_ids for name in node.output}
    for name in first.input:
        if name in computed_by_backward:
            return name
    before = [node for node in graph.node if id(node) not in forward_ids and order[id(node)] < order[id(first)]]
    return before[-1].output[0]


def copy_block(block: Block, grown: set, trigger: str) -> list:
    """The copies that compute `block.recomputed` again, in forward order, after `late` nodes
    that hold the activations the block reads from outside until `trigger` exists."""
    from onnx import helper

    producer = {name: node for node in block.nodes for name in node.output}
    needed: set = set()
    stack = list(block.recomputed)
    while stack:
        node = producer.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            # A Dropout's copy reads the forward's mask, so only its data input is recomputed.
            stack.extend(node.input[:1] if node.op_type in DROPOUT_OPS else node.input)
    copied = {name for node in block.nodes if id(node) in needed for name in node.output if name}
    late_inputs: list[str] = []
    nodes = []
    for node in (node for node in block.nodes if id(node) in needed):
        inputs = []
        for name in node.input:
            if name in copied:
                inputs.append(name + SUFFIX)
            elif name in grown:  # an activation from outside the block
                late_inputs += [name] if name not in late_inputs else []
                inputs.append(late_name(name, block))
            else:  # a weight or a constant
                inputs.append(name)
        if node.op_type in DROPOUT_OPS:
            # The forward's mask, not a new draw: DropoutGrad(x, mask, ratio, training_mode).
            copy = helper.make_node("DropoutGrad", [inputs[0], node.output[1], *inputs[1:3]],
                                    [node.output[0] + SUFFIX], name=node.name + SUFFIX, domain="com.microsoft")
        else:
            copy = helper.make_node(node.op_type, inputs, [name + SUFFIX if name else "" for name in node.output],
                                    name=node.name + SUFFIX, domain=node.domain)
            copy.attribute.extend(node.attribute)
        nodes.append(copy)
    return [*late(late_inputs, trigger, block), *nodes]


def late_name(name: str, block: Block) -> str:
    """The alias of `name` that `block`'s copies read (one per block: an attention mask
    computed in the first block is read by every block)."""
    return f"{name}_late_for_{block.name}{SUFFIX}"


def late(names: list[str], trigger: str, block: Block) -> list:
    """For each tensor of `names`, `late_name`: the same tensor (a Reshape to its own shape, which
    ONNX Runtime runs as an alias, no copy) that waits for `trigger`, through a shape plus
    0 x Size(trigger)."""
    from onnx import helper

    size, zero = f"{trigger}_size_for_{block.name}{SUFFIX}", f"{trigger}_zero_for_{block.name}{SUFFIX}"
    nodes = [helper.make_node("Size", [trigger], [size], name=size),
             helper.make_node("Sub", [size, size], [zero], name=zero)]
    for name in names:
        shape = f"{name}_shape_for_{block.name}{SUFFIX}"
        nodes += [helper.make_node("Shape", [name], [shape], name=shape),
                  helper.make_node("Add", [shape, zero], [f"{shape}_late"], name=f"{shape}_late"),
                  helper.make_node("Reshape", [name, f"{shape}_late"], [late_name(name, block)],
                                   name=late_name(name, block))]
    return nodes
