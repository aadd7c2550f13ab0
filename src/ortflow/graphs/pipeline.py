"""Pipeline stages (issue 32): the forward model cut into P stages at tensors where one
activation crosses, and each stage's training, eval and optimizer graphs.

The cut. Tensors are "weighted" when a float initializer (a parameter, trainable or
not) lies behind them. A tensor T is a boundary when it is the only weighted tensor
that nodes before it in graph order hand to nodes after it: stage s then computes
from the stage before it that one activation, and from the batch's inputs (token ids,
an attention mask) whatever else it needs, recomputing the few nodes without weights
that derive masks and positions from them. Shapes are not activations: a `Shape` of a
weighted tensor is rewritten first into the batch's input dimensions and constants
(`shapes_from_inputs`): transformers' GPT-2 reads the shape of its embedding's output
in every block, and without the rewrite has no boundary between its blocks. The
boundaries are found in graph order (in a transformer, the residual stream between
blocks and between a block's attention and its MLP); the cut points are chosen among
them to balance the stages' parameters (or forward FLOPs), or named.

Tied weights (GPT-2's token embedding, read by the first stage's lookup and the last
stage's head) are held by every stage that reads them, as DeepSpeed's pipeline engine
does with its tied modules: each such stage's graph computes the gradient of its own
use, and the schedule must sum those gradients across the stages that hold the tensor
before the optimizer step (`Plan.tied`); every holder then applies the same update to
the same weight. Refusing them would refuse every GPT-2-shaped model whose
embedding is not in the same stage as its head, that is, nearly every cut of them.

The graphs (generate_artifacts on each stage's forward model, `build`):
- the last stage has the real loss against the data's label;
- a stage s < P-1 has the loss ReduceSum(output * upstream_gradient), where
  `<output>.upstream_gradient` is an input: the gradient of the whole model's loss
  with respect to its output, which stage s+1 sends back. The gradients of the
  parameters of stage s are then those of the whole model (the chain rule);
- every stage but the first returns the gradient of the loss with respect to its
  input activation as the output `<input>.gradient`: ORT builds `<input>_grad` when
  the input is named in requires_grad, but makes it an accumulation buffer that
  `Module` never allocates; that accumulator is removed and `Identity(<input>_grad)`
  returned under a name that does not end in `_grad` (`Module` hides such outputs).

What the 1F1B schedule over MPI needs from these pieces, per micro-batch:
- forward: stage s sends its output (`Stage.output`: float32 [batch, *dims], the dims
  in `Stage.output_shape`, a name where the data's text length is dynamic, which
  `Plan.shape` resolves from the batch's shapes for the receiving side) to stage s+1,
  which feeds it as its input of the same name. Every stage is fed the batch's
  features it reads (`Stage.features`: GPT-2's later stages read the token ids again,
  for their masks and positions), the last stage also the label. `Module` runs forward
  and backward in one call, so a stage but the last runs its forward twice: once in
  its eval graph to send (its loss needs `<output>.upstream_gradient`: zeros), and
  again in its training step once the gradient has come back.
- backward: stage s+1 sends `<input>.gradient` (the activation's shape) back to stage
  s, which feeds it as `<output>.upstream_gradient`.
- Dropout: ONNX Runtime's CPU Dropout draws each call's mask from one generator per
  process, which `onnxruntime.set_seed` resets and each Dropout call advances. The
  whole model's Dropouts run stage by stage, so stage s seeded with the whole model's
  seed plus `Stage.dropouts_before` draws the whole model's masks. The eval graph, which
  ORT builds with Dropout off, gets the bool input `dropout.training_mode`
  (`switchable_dropout`): True in the forward a stage sends, so that it draws the
  masks its training step draws again; False to evaluate.
- the gradients of tied weights summed across `Plan.tied`'s stages before the
  optimizer step; the global norm for clipping summed over the stages, a tied weight
  counted once; each stage's own optimizer state.

Measured (tests/test_pipeline.py, ORT 1.19.2 CPU, one thread): the built-in gpt (2
layers, width 16, tied head), transformers' GPT-2 (2 layers, width 64, Dropout 0.1) and
a BERT classifier (2 layers, width 32, Dropout 0.1, an attention mask fed to the stages
that read it) in 2 and 3 stages give the whole model's loss and every gradient bit for
bit, batch 8.
A forward sent with Dropout off gives GPT-2's gradients 0.05 off, stages seeded without
the offset 0.08 off. On two threads the embedding's gradient (ORT's GatherGrad) varies
by up to 3e-8 from run to run. Stage 0 of GPT-2 (2 stages, batch 8): its eval graph's
forward 5 ms, its training graph's forward and backward 10 to 17 ms, so the forward it
runs twice costs a third to a half of its training step more.
Not done here: models over external_data.threshold() (the stages' models are built in
memory), train.recompute on a stage's graph, BatchNorm (refused: the forward a stage
sends would normalize with the running statistics; its eval graph's BatchNorm would
need switching as its Dropout is), and stage costs count a tied weight in the first
stage that reads it only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from .. import external_data, records
from ..artifacts import Artifacts
from ..data.manifest import Column, Manifest
from ..errors import ConfigError, ModelError
from ..models import is_float
from ..models.export_fixes import infer_shapes
from ..onnx_nodes import attributes
from .description import REMEDY
from .generate import generate_with_loss
from .loss import loss_block

log = logging.getLogger("ortflow.build_artifacts")

UPSTREAM = ".upstream_gradient"  # stage s's input for the gradient stage s+1 sends back
GRADIENT = ".gradient"  # stage s's output: the gradient of the loss w.r.t. its input activation
# ORT's name for the gradient it builds of a tensor named in requires_grad, and of its accumulation.
ORT_GRADIENT, ACCUMULATION_BUFFER, ACCUMULATION_OUT = "_grad", "_grad.accumulation.buffer", "_grad.accumulation.out"
BALANCES = ("parameters", "flops")
# The eval graphs' input that turns their Dropouts on (switchable_dropout).
DROPOUT = "dropout.training_mode"


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    input: str | None  # the activation it receives (None for the first stage)
    output: str  # the activation it sends (the model's output for the last stage)
    output_shape: tuple[int | str, ...]  # its dims, a str for a symbolic one (the batch's, a text's length)
    features: tuple[str, ...]  # the batch's inputs it reads
    parameters: tuple[str, ...]  # the float initializers it reads
    dropouts_before: int  # Dropout nodes of the stages before it (the seed's offset)
    # The elements of its parameters, for the memory estimate (training/preflight.py); absent
    # from a pipeline.json written before it was counted.
    held: int | None = None
    # The stage's forward ModelProto, from `cut` (build writes it): not in pipeline.json, read without it.
    model: Any = dataclasses.field(default=None, kw_only=True, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The cut, as pipeline.json keeps it (read_plan): its stages without their models."""

    balance: str
    costs: tuple[int, ...]  # each stage's parameters (elements) or forward FLOPs per sample
    tied: dict  # a parameter read by more than one stage -> those stages ([int])
    symbols: dict  # a symbolic dim -> (the batch's input, axis) that has it
    stages: tuple[Stage, ...]

    def shape(self, dims: list, feature_shapes: dict[str, tuple]) -> list[int]:
        """`dims` (a Stage.output_shape) for a batch whose features have `feature_shapes`:
        the size of what a stage receives, which a receive must know before it comes."""
        if any(isinstance(d, str) and d not in self.symbols for d in dims):
            raise ModelError(f"pipeline: activation dims {dims} name a dim no input of the model has {self.symbols}")
        return [feature_shapes[self.symbols[d][0]][self.symbols[d][1]] if isinstance(d, str) else d for d in dims]



def read_plan(path: Path) -> Plan:
    """pipeline.json (Artifacts.pipeline_json): the plan `write_plan` wrote, its stages without their
    models, every field checked (records.py); what the schedule reads at training time."""
    return records.read(Plan, path, ModelError, REMEDY)


def write_plan(path: Path, plan: Plan) -> None:
    """pipeline.json as ortflow has always written it: the plan's fields in order, the stages' models
    left out (dataclasses.asdict would copy them)."""
    fields = [field.name for field in dataclasses.fields(Stage) if field.name != "model"]
    stages = [{name: getattr(stage, name) for name in fields} for stage in plan.stages]
    records.write_data(path, {"balance": plan.balance, "costs": plan.costs, "tied": plan.tied,
                              "symbols": plan.symbols, "stages": stages})


def held_by_stages(artifacts: Artifacts) -> list[int] | None:
    """Each stage's parameter elements (Stage.held) in the cut of `artifacts`; None where they
    are not cut into stages, or their pipeline.json does not count them."""
    if not artifacts.pipeline_json.is_file():
        return None
    held = [stage.held for stage in read_plan(artifacts.pipeline_json).stages]
    return None if None in held else held


def check_stages(artifacts: Artifacts, stages: int) -> None:
    """With train.pipeline_stages P > 1, the artifacts are cut into P stages (their pipeline.json).
    Any artifacts hold the whole model's graphs, which a run with P = 1 trains."""
    if stages == 1 or not artifacts.model_json.is_file():  # without model.json the ranks name what is missing
        return
    built = len(read_plan(artifacts.pipeline_json).stages) if artifacts.pipeline_json.is_file() else 1
    if built != stages:
        raise ConfigError(
            f"config key 'train.pipeline_stages': {stages} stages, but the artifacts {artifacts.folder} are cut into "
            f"{built} ({artifacts.pipeline_json.name}); rebuild them with train.pipeline_stages: {stages}, or set "
            f"train.pipeline_stages: {built}")


def weighted_tensors(graph) -> set[str]:
    """The tensors a float initializer lies behind (graph order is topological)."""
    weighted = {t.name for t in graph.initializer if is_float(t)}
    for node in graph.node:
        if any(name in weighted for name in node.input):
            weighted.update(name for name in node.output if name)
    return weighted


def dims_of(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def input_symbols(graph) -> dict[str, tuple[str, int]]:
    """Each symbolic dim of the graph's inputs -> (the first input that has it, its axis)."""
    initializers = {t.name for t in graph.initializer}
    symbols: dict[str, tuple[str, int]] = {}
    for value in graph.input:
        if value.name not in initializers:
            for axis, dim in enumerate(dims_of(value)):
                if isinstance(dim, str) and dim:
                    symbols.setdefault(dim, (value.name, axis))
    return symbols


def shapes_from_inputs(model) -> int:
    """Rewrite in place each Shape node of a weighted tensor whose dims are known, each
    either a constant or a dimension of one of the graph's inputs (the batch, a text's
    length), into those: Concat(Shape(input)[axis], constants), which a later stage can
    compute from the batch alone. Returns how many were rewritten."""
    import onnx
    from onnx import helper

    graph = model.graph
    types = {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}
    symbols = input_symbols(graph)
    weighted = weighted_tensors(graph)
    nodes, rewritten = [], 0
    for node in graph.node:
        value = types.get(node.input[0]) if node.op_type == "Shape" and node.input[0] in weighted else None
        dims = dims_of(value) if value is not None and value.type.tensor_type.HasField("shape") else None
        # A dim of 0 is one shape inference could not tell.
        if dims is None or any(d == 0 or isinstance(d, str) and d not in symbols for d in dims):
            nodes.append(node)
            continue
        found = attributes(node)
        start, end = found.get("start", 0), found.get("end", len(dims))
        kept = dims[slice(start, end)]
        pieces, out = [], node.output[0]
        for index, dim in enumerate(kept):
            piece = f"{out}.dim{index}"
            if isinstance(dim, int):
                nodes.append(helper.make_node("Constant", [], [piece],
                                              value=onnx.numpy_helper.from_array(np.array([dim], np.int64))))
            else:
                source, axis = symbols[dim]
                nodes.append(helper.make_node("Shape", [source], [piece], start=axis, end=axis + 1))
            pieces.append(piece)
        if pieces:
            nodes.append(helper.make_node("Concat", pieces, [out], axis=0, name=node.name))
        else:
            nodes.append(helper.make_node("Constant", [], [out], name=node.name,
                                          value=onnx.numpy_helper.from_array(np.zeros(0, np.int64))))
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return rewritten


def boundaries(graph, weighted: set[str]) -> list[tuple[int, str]]:
    """(index, tensor) for each position in graph order where one weighted float tensor
    alone crosses: produced by the nodes before `index`, read by a node from `index` on
    (or a graph output)."""
    import onnx

    floats = {v.name for v in [*graph.value_info, *graph.output]
              if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    last_read = {name: index for index, node in enumerate(graph.node) for name in node.input}
    last_read.update({o.name: len(graph.node) for o in graph.output})
    crossing: set[str] = set()
    found = []
    for index, node in enumerate(graph.node):
        crossing = {name for name in crossing if last_read[name] >= index}
        if index and len(crossing) == 1 and next(iter(crossing)) in floats:
            found.append((index, next(iter(crossing))))
        crossing.update(name for name in node.output if name in weighted and name in last_read)
    return found


def node_costs(model, balance: str, manifest: Manifest | None) -> list[int]:
    """Per node in graph order: the elements of the float initializers it is the first to
    read (`parameters`), or its forward FLOPs per sample (`flops`, graphs/cost.py)."""
    from .cost import node_flops, per_sample_values

    graph = model.graph
    if balance == "flops":
        flops = node_flops(graph.node, per_sample_values(model, manifest))
        return [flops.get(index, 0) for index in range(len(graph.node))]
    sizes = {t.name: int(np.prod(t.dims)) for t in graph.initializer if is_float(t)}
    costs = []
    for node in graph.node:
        costs.append(sum(sizes.pop(name, 0) for name in dict.fromkeys(node.input)))
    return costs


def balanced_cuts(candidates: list[tuple[int, str]], costs: list[int], stages: int) -> list[str]:
    """The `stages - 1` boundaries that make the largest stage's cost the smallest (each
    stage costing something), the first of equal ones."""
    prefix = np.concatenate([[0], np.cumsum(costs)])
    total = int(prefix[-1])
    points, seen = [], set()
    for index, name in candidates:  # one boundary per distinct cost before it, the first
        before = int(prefix[index])
        if 0 < before < total and before not in seen:
            seen.add(before)
            points.append((before, name))
    if len(points) < stages - 1:
        raise ModelError(f"pipeline: the model has {len(points) + 1} stage(s) at most, fewer than the {stages} "
                         f"asked for (boundaries where one activation crosses: {named(points)})")
    memo: dict = {}

    def best(cuts_left: int, first: int, before: int) -> tuple[int, list[str]]:
        """The smallest largest stage cost of what follows `before` (the cost up to points[first - 1]), cut
        `cuts_left` times at points[first:], and those cuts."""
        if cuts_left == 0:
            return total - before, []
        key = (cuts_left, first)
        if key not in memo:
            options = []
            for i in range(first, len(points) - cuts_left + 1):
                largest, rest = best(cuts_left - 1, i + 1, points[i][0])
                options.append((max(points[i][0] - before, largest), [points[i][1], *rest]))
            memo[key] = min(options, key=lambda option: option[0])
        return memo[key]

    return best(stages - 1, 0, 0)[1]


def cut(base, stages: int, balance: str = "parameters", at: list[str] | None = None,
        manifest: Manifest | None = None) -> Plan:
    """Cut the forward model `base` (with its weights) into `stages` stages, at the
    tensors `at` if given, else balanced by `balance` (`flops` reads the data's shapes
    from `manifest`); refuse an impossible cut in one line."""
    if balance not in BALANCES:
        raise ModelError(f"pipeline: balance {balance!r} is not one of {list(BALANCES)}")
    model = copy.deepcopy(base)
    infer_shapes(model)
    rewritten = shapes_from_inputs(model)
    weighted = weighted_tensors(model.graph)
    candidates = boundaries(model.graph, weighted)
    costs = node_costs(model, balance, manifest)
    if at is None:
        cuts = balanced_cuts(candidates, costs, stages)
    elif len(at) != stages - 1:
        raise ModelError(f"pipeline: {len(at)} cut point(s) {at} for {stages} stages; name {stages - 1}")
    else:
        cuts = list(at)
    for name in cuts:
        if name not in weighted or not any(name in node.output for node in model.graph.node):
            raise ModelError(f"pipeline: cut point {name!r} is not an activation of the model (a tensor that "
                             f"parameters lie behind); boundaries where one activation crosses: {named(candidates)}")
    types = {v.name for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    unknown = [name for name in cuts if name not in types]
    if unknown:
        raise ModelError(f"pipeline: the shape of cut point {unknown[0]!r} is unknown (shape inference could not "
                         "follow the model to it); name another cut point")
    statistics = [node.name or node.output[0] for node in model.graph.node if node.op_type == "BatchNormalization"]
    if statistics and stages > 1:
        # A stage sends the forward of its eval graph, where BatchNorm normalizes with its running
        # statistics, not with the batch's as the training step does (Dropout is switchable there).
        raise ModelError(f"pipeline: the model has BatchNormalization ({statistics[0]}, {len(statistics)} in all), "
                         "which pipeline stages do not support yet; train it with 1 stage")
    plan_stages, nodes = extract(model, weighted, cuts, candidates)
    readers: dict[str, list[int]] = {}
    for stage in plan_stages:
        for name in stage.parameters:
            readers.setdefault(name, []).append(stage.index)
    tied = {name: held for name, held in readers.items() if len(held) > 1}
    stage_costs = [sum(costs[i] for i in stage_nodes) for stage_nodes in nodes]
    log.info("pipeline: %d stages at %s, %s %s%s%s", stages, cuts, balance, stage_costs,
             f", tied {tied}" if tied else "", f" ({rewritten} Shape nodes read from the inputs)" if rewritten else "")
    return Plan(balance, tuple(stage_costs), tied, input_symbols(model.graph), tuple(plan_stages))


def extract(model, weighted: set[str], cuts: list[str], candidates: list) -> tuple[list[Stage], list[set[int]]]:
    """The stages between the cut points (and each one's node indices): stage s computes cut
    point s from cut point s - 1 and the batch's inputs. Refused: cut points out of order, and
    a cut point that another weighted tensor crosses."""
    graph = model.graph
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}
    ends, starts = [*cuts, graph.output[0].name], [None, *cuts]
    reached: set[int] = set()  # nodes of the stages so far
    stages, stage_nodes, dropouts = [], [], 0
    for index, (start, end) in enumerate(zip(starts, ends)):
        nodes = ancestors(graph, producer, end, start)
        fresh = [graph.node[i] for i in sorted(nodes - reached)]
        if start is not None and (producer[end] in reached or start not in {n for node in fresh for n in node.input}):
            raise ModelError(f"pipeline: cut point {start!r} does not lie before {end!r} (the cut points must "
                             "follow the model's order)")
        # What this stage reads of the stages before it, besides its input: weighted tensors (activations)
        # cannot be recomputed here, the rest (masks, positions from the batch's inputs) is.
        crossing = [name for node in fresh for name in node.input
                    if name != start and name in weighted and producer.get(name) in reached]
        if crossing:
            raise ModelError(f"pipeline: cut point {start!r} is not a single boundary: {crossing[0]!r} crosses it "
                             f"too; boundaries where one activation crosses: {named(candidates)}")
        own = [graph.node[i] for i in sorted(nodes)]
        stages.append(stage_model(model, own, index, start, end, dropouts))
        stage_nodes.append(nodes)
        dropouts += sum(1 for node in own if node.op_type == "Dropout" and node.output[0] in weighted)
        reached |= nodes
    return stages, stage_nodes


def stage_model(model, nodes: list, index: int, start: str | None, end: str, dropouts_before: int) -> Stage:
    """Stage `index`: the forward model of `nodes`, from the batch's inputs they read and
    the activation `start` to `end`, with the initializers they read."""
    import onnx

    graph = model.graph
    types = {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}
    initializers = {t.name: t for t in graph.initializer}
    read = list(dict.fromkeys(name for node in nodes for name in node.input))
    features = [v.name for v in graph.input if v.name in read and v.name not in initializers]
    stage_graph = onnx.helper.make_graph(
        nodes, f"{graph.name}.stage{index}", [types[name] for name in features] + ([types[start]] if start else []),
        [types[end]], [initializers[name] for name in read if name in initializers],
        value_info=[types[name] for node in nodes for name in node.output if name in types and name != end])
    stage = onnx.helper.make_model(stage_graph, opset_imports=model.opset_import, ir_version=model.ir_version,
                                   functions=model.functions)
    parameters = [name for name in read if name in initializers and is_float(initializers[name])]
    held = sum(math.prod(initializers[name].dims) for name in parameters)
    return Stage(index, start, end, tuple(dims_of(types[end])), tuple(features), tuple(parameters), dropouts_before,
                 held, model=stage)


def named(candidates: list[tuple[int, str]], shown: int = 12) -> str:
    """The boundaries' tensors, each once, the first `shown` of them."""
    names = list(dict.fromkeys(name for _, name in candidates))
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def ancestors(graph, producer: dict[str, int], end: str, start: str | None) -> set[int]:
    """Indices of the nodes that compute `end`, not looking behind `start`."""
    found, stack = set(), [end]
    while stack:
        name = stack.pop()
        index = producer.get(name)
        if name == start or index is None or index in found:
            continue
        found.add(index)
        stack.extend(graph.node[index].input)
    return found


def upstream_product(output):
    """The loss of a stage before the last: ReduceSum(output * upstream_gradient), whose
    gradient with respect to `output` is the upstream gradient itself."""
    import onnx
    from onnxruntime.training import onnxblock

    class UpstreamProduct(onnxblock.Block):
        def build(self, output_name: str):
            upstream = f"{output_name}{UPSTREAM}"
            self.base.graph.input.append(onnx.helper.make_tensor_value_info(
                upstream, output.type.tensor_type.elem_type, dims_of(output)))
            product, total = f"{output_name}.times_upstream", f"{output_name}.stage_loss"
            self.base.graph.node.append(onnx.helper.make_node("Mul", [output_name, upstream], [product]))
            self.base.graph.node.append(onnx.helper.make_node("ReduceSum", [product], [total], keepdims=0))
            return total

    return UpstreamProduct()


def build(plan: Plan, trainable: list[str], loss: str, label: Column, optimizer, out: Path, logits) -> list[Path]:
    """Each stage's artifacts in `out`/stage-<s> (Artifacts.stage): its forward model, training,
    eval and optimizer graphs and initial checkpoint; and the plan in `out`/pipeline.json.
    Returns the stages' folders."""
    folders = []
    last = len(plan.stages) - 1
    Path(out).mkdir(parents=True, exist_ok=True)
    write_plan(Artifacts(out).pipeline_json, plan)
    for stage in plan.stages:
        folder = Artifacts(out).stage(stage.index).folder
        folder.mkdir(parents=True, exist_ok=True)
        external_data.save_model(stage.model, Artifacts(folder).base_model)
        own = [name for name in stage.parameters if name in trainable]
        if not own:
            raise ModelError(f"pipeline: stage {stage.index} ({stage.input} -> {stage.output}) holds no trainable "
                             "parameter; cut elsewhere or use fewer stages")
        frozen = [name for name in stage.parameters if name not in trainable]
        requires_grad = own + ([stage.input] if stage.input else [])
        if stage.index == last:
            make_loss, loss_input = (lambda: loss_block(loss, label, logits)), logits.name
        else:
            output = stage.model.graph.output[0]
            make_loss, loss_input = (lambda: upstream_product(output)), stage.output
        generate_with_loss(stage.model, requires_grad, frozen, make_loss, loss_input, optimizer, folder)
        if stage.input:
            expose_input_gradient(Artifacts(folder).training_model, stage.input)
        switchable_dropout(Artifacts(folder).eval_model)
        folders.append(folder)
    return folders


def switchable_dropout(path: Path) -> int:
    """Give the Dropouts of the eval graph at `path` (which ORT builds with Dropout off) the
    bool input DROPOUT as their training_mode: True to draw the training graph's masks in
    the forward a stage sends, False to evaluate. Returns how many Dropouts read it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dropouts = [node for node in model.graph.node if node.op_type == "Dropout"]
    for node in dropouts:
        inputs = [*node.input, "", ""][:3]
        inputs[2] = DROPOUT
        del node.input[:]
        node.input.extend(inputs)
    if dropouts:
        model.graph.input.append(onnx.helper.make_tensor_value_info(DROPOUT, onnx.TensorProto.BOOL, []))
        onnx.save(model, str(path))
    return len(dropouts)


def expose_input_gradient(path: Path, name: str) -> None:
    """Return `<name>_grad`, the gradient generate_artifacts built for the graph input
    `name`, as the output `<name>.gradient`, without the accumulation buffer it gave it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    accumulator = next(node for node in graph.node if name + ACCUMULATION_OUT in node.output)
    graph.node.remove(accumulator)
    for values in (graph.input, graph.output):
        for value in [v for v in values if v.name in (name + ACCUMULATION_BUFFER, name + ACCUMULATION_OUT)]:
            values.remove(value)
    graph.node.append(onnx.helper.make_node("Identity", [name + ORT_GRADIENT], [name + GRADIENT]))
    activation = next(v for v in graph.input if v.name == name)
    graph.output.append(onnx.helper.make_tensor_value_info(name + GRADIENT, activation.type.tensor_type.elem_type,
                                                           dims_of(activation)))
    onnx.save(model, str(path))
