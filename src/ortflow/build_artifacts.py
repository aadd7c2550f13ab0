"""The build_artifacts stage: a model and the train split's manifest in, the
graphs and initial checkpoint that ONNX Runtime's training engine runs out.

1. The forward model as ONNX (`inference_base.onnx`): a built-in or user torch
   module exported at opset 16 (ORT 1.19's gradient builder fails on opset 17's
   LayerNormalization), or the user's ONNX file, with `model.weights` loaded into
   it first (models/weights.py). Its inputs are named like the data's features;
   its one output holds the logits.
2. `generate_artifacts` adds the loss (with a label input named like the data's
   label) and the gradient graph (`training_model.onnx`), the same without
   gradients (`eval_model.onnx`), the optimizer (`optimizer_model.onnx`, no
   gradient clipping: training clips globally after the all-reduce) and the
   initial weights (`checkpoint`). Both training and eval graphs return
   (loss, logits); the training graph then BatchNorm's updated running
   statistics, and the eval graph normalizes with them (batchnorm.py).
3. One training step on a few train records proves that the graphs fit the data.
4. `model.json` describes the inputs, label, outputs, parameters, FLOPs and
   running statistics (`running_stats`: training graph output -> parameter).

Everything is written to `<out>.tmp` and renamed to `<out>` when complete (atomic.folder).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
from pathlib import Path

import numpy as np

from . import atomic, external_data, ort_private
from .artifacts import Artifacts
from .checkpoints.ort_format import apply_threshold
from .errors import MissingInputError, ModelError
from .inference import inference_session
from .sessions import quiet_logging
from .models import CLASS_LOSSES, LOGITS, batchnorm, is_float, vocabulary
from .models.logits import Logits, find as find_logits

log = logging.getLogger("ortflow.build_artifacts")

OPSET = 16
SMOKE_RECORDS = 4
# ORT's loss blocks by config name; bce_with_logits is ortflow's own (losses.py).
LOSS_BLOCKS = {"cross_entropy": "CrossEntropyLoss", "mse": "MSELoss", "l1": "L1Loss"}
# What onnxblock's blocks save of a model given by its path, in their working folder (blocks.Block's temp_file_name).
ORT_BLOCK_FILES = ("temp.onnx", "temp.onnx.data")


def resolve_loss(loss: str, manifest: dict) -> str:
    """`model.loss`, with `auto` chosen by the task, checked against the label."""
    task, label = manifest["task"], manifest["label"]
    if loss == "auto":
        loss = "mse" if task == "regression" else "cross_entropy"
    integral = np.issubdtype(np.dtype(label["dtype"]), np.integer) or label["dtype"] == "bool"
    described = f"the data's label {label['name']!r} is {label['dtype']} (task {task})"
    if loss in CLASS_LOSSES and not integral:
        raise ModelError(
            f"model.loss: {loss!r} needs integer class labels but {described}; "
            "use mse, l1 or bce_with_logits for float targets, or set data.task: classification"
        )
    if loss in ("mse", "l1") and integral:
        raise ModelError(
            f"model.loss: {loss!r} compares outputs with float targets but {described}; use cross_entropy for classes"
        )
    if loss == "bce_with_logits" and integral and manifest["num_classes"] != 2:
        raise ModelError(
            f"model.loss: 'bce_with_logits' needs float targets in [0, 1] or two classes but {described} "
            f"with {manifest['num_classes']} classes; use cross_entropy"
        )
    return loss


def export_torch(module, manifest: dict, path: Path):
    """torch -> ONNX (written to `path` and returned) with the batch dimension dynamic, in training mode and
    without constant folding, so that every parameter stays an initializer;
    with export_fixes' repairs (torch.diff, cumsum, the attention's dropout, the embedding's padding row,
    initializers merged by value),
    and the buffers (BatchNorm's running statistics) as they were before the export ran the module."""
    import onnx
    import torch

    from .models import export_fixes, user

    export_fixes.register_symbolics(OPSET)
    export_fixes.check_embeddings(module)
    features = user.forward_features(module, manifest)
    example = tuple(torch.zeros([2, *f["shape"]], dtype=getattr(torch, f["dtype"])) for f in features)
    names = [f["name"] for f in features]
    buffers = batchnorm.buffers_before_export(module)
    try:
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=names,
            output_names=[LOGITS],
            dynamic_axes={name: {0: "batch"} for name in [*names, LOGITS]},
            opset_version=OPSET,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            dynamo=False,
        )
    except torch.onnx.errors.UnsupportedOperatorError as error:
        raise export_fixes.unsupported_operator(error, type(module).__name__, OPSET) from None
    except torch.onnx.errors.SymbolicValueError as error:  # its message goes on with the traced graph
        problem = str(error).splitlines()[0].split("  [Caused by")[0].strip()
        raise ModelError(f"model.path: torch.onnx cannot export {type(module).__name__}: {problem}") from None
    # A model over 2 GB comes with one external data file per tensor (initializers and Constant
    # nodes' values), named after it: they are read in and written again as one
    # (external_data.save_model), or not at all.
    from onnx.external_data_helper import _get_all_tensors

    exported = onnx.load(str(path), load_external_data=False)
    scattered = {entry.value for tensor in _get_all_tensors(exported)
                 for entry in tensor.external_data if entry.key == "location"}
    if scattered:
        onnx.load_external_data_for_model(exported, str(path.parent))
        for name in scattered:
            (path.parent / name).unlink()
    untied = export_fixes.untie_initializers(exported, module)
    if untied:
        log.warning("model.path: %s stayed in eval mode while exported, so torch.onnx merged its parameters and "
                    "buffers of equal value; each has its own initializer again: %s", type(module).__name__,
                    sorted(untied))
    changed = len(untied) + export_fixes.give_dropout_its_mask(exported) + batchnorm.restore_buffers(exported, buffers)
    if changed or scattered or external_data.initializer_bytes(exported) > external_data.threshold():
        external_data.save_model(exported, path)
    return exported


def base_model(model: dict, manifest: dict, loss: str, seed: int, path: Path):
    """Write the forward ONNX model to `path`, with `model.weights` loaded if given;
    return it and the names of the torch parameters that train (None for an ONNX
    file: every float initializer). Over external_data.threshold() its initializers go
    to `inference_base.onnx.data`, and the model returned holds their shapes, not their
    values (what the checks and model.json read; generate_artifacts reads the file)."""
    import torch

    from .models import built_in, user, weights

    if model["kind"] == "onnx":
        base = user.load_onnx(model["path"])
        if model["weights"]:
            weights.load_into_onnx(base, model["weights"], model["weights_skip"])
        external_data.save_model(base, path)
        return base, None
    # Every weight drawn in the constructor comes from the seed, including a new
    # head that a wrapper adds to a model it loads with from_pretrained.
    torch.manual_seed(seed)
    module = user.import_torch(model["path"], model["kwargs"]) if model["kind"] == "torch" else built_in(
        model, manifest, loss
    )
    if model["weights"]:
        weights.load_into_module(module, model["weights"], model["weights_skip"])
    # As constructed, in training mode: torch.onnx deprecates its `training` argument for the module's own mode.
    return export_torch(module, manifest, path), [n for n, p in module.named_parameters() if p.requires_grad]


def float_initializers(base) -> dict[str, int]:
    """Name -> element count of the float initializers (the candidate parameters)."""
    return {t.name: math.prod(t.dims) for t in base.graph.initializer if is_float(t)}


def split_parameters(base, model: dict, torch_trainable: list[str] | None) -> tuple[list[str], list[str]]:
    """(trainable, frozen) parameter names: those `model.trainable` picks if given, else
    the torch module's parameters or the ONNX file's float initializers, minus those
    `model.frozen` picks. Both take train.optimizer.no_decay's patterns and rules
    (weight_decay.is_excluded); each entry must pick a parameter. BatchNorm's running
    statistics are float initializers but never train (batchnorm.check_trainable)."""
    from .training.weight_decay import is_excluded

    parameters = float_initializers(base)
    ndim = {t.name: len(t.dims) for t in base.graph.initializer}
    tables = set(embedding_tables(base, list(parameters)))
    statistics = batchnorm.running_statistics(base)

    def picked(key: str) -> list[str]:
        for entry in model[key] or []:
            matches = [n for n in parameters if is_excluded(n, ndim[n], tables, [entry])]
            if not matches:
                raise ModelError(f"model.{key}: {entry!r} matches none of the model's parameters: "
                                 f"{', '.join(sorted(parameters)[:8])}{', ...' if len(parameters) > 8 else ''} "
                                 f"({len(parameters)} in all; patterns as train.optimizer.no_decay's)")
            if key == "trainable" and all(n in statistics for n in matches):
                batchnorm.check_trainable(base, matches)
        return [n for n in parameters if is_excluded(n, ndim[n], tables, model[key] or [])]

    frozen = set(picked("frozen"))
    if model["trainable"] is not None:
        candidates = [n for n in picked("trainable") if n not in statistics]
    else:
        candidates = torch_trainable if torch_trainable is not None else [n for n in parameters if n not in statistics]
    trainable = [n for n in candidates if n in parameters and n not in frozen]
    if not trainable:
        raise ModelError("model: no parameter is left to train (check model.trainable and model.frozen)")
    return trainable, [n for n in parameters if n not in trainable]


def check_interface(base, manifest: dict) -> None:
    """The model's inputs are the data's features (names and element types),
    and it has one output, the logits."""
    import onnx

    initializers = {t.name for t in base.graph.initializer}
    inputs = [i for i in base.graph.input if i.name not in initializers]
    model_names = [i.name for i in inputs]
    data_names = [f["name"] for f in manifest["features"]]
    if sorted(model_names) != sorted(data_names):
        raise ModelError(
            f"model inputs {model_names} do not match the data's feature names {data_names}; "
            "name the model's inputs like data.features (or set data.features to the model's input names)"
        )
    dtypes = {f["name"]: f["dtype"] for f in manifest["features"]}
    for i in inputs:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name
        if dtype != dtypes[i.name]:
            raise ModelError(f"model input {i.name!r} is {dtype} but the data's feature {i.name!r} is {dtypes[i.name]}")
    if len(base.graph.output) != 1:
        raise ModelError(
            f"the model has outputs {[o.name for o in base.graph.output]}; ortflow trains a model with one output (the logits)"
        )
    if manifest["label"]["name"] in {n for node in base.graph.node for n in [*node.input, *node.output]} | set(
        model_names
    ):
        raise ModelError(
            f"the data's label name {manifest['label']['name']!r} is already a tensor name in the model; "
            "rename data.label"
        )


def loss_block(loss: str, label: dict, logits: Logits):
    """ORT's loss block behind a label input that has the data's name, dtype
    and shape ([batch, *label shape]); ORT's own blocks would derive the label's
    shape from the logits, which is wrong for [batch, classes, time] logits.
    The label is cast to the type the loss wants (integer 0/1 labels to float
    for bce_with_logits; a no-op otherwise). Logits that differ from the label's
    layout in size-1 dimensions only are reshaped to it (models/logits.py)."""
    import onnx
    from onnxruntime.training import onnxblock

    from .models import losses

    class LabelledLoss(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.inner = (
                losses.stable_bce_with_logits()
                if loss == "bce_with_logits"
                else getattr(onnxblock.loss, LOSS_BLOCKS[loss])()
            )

        def build(self, logits_name: str):
            if logits.reshape:  # Reshape's 0 keeps the batch (and classes) as they are: [N, C, 1, 1] -> [N, C]
                dims = f"{logits_name}.label_layout_shape"
                kept = [0, 0] if loss in CLASS_LOSSES else [0]
                self.base.graph.initializer.append(
                    onnx.numpy_helper.from_array(np.array([*kept, *label["shape"]], np.int64), dims))
                squeezed = f"{logits_name}.label_layout"
                self.base.graph.node.append(onnx.helper.make_node("Reshape", [logits_name, dims], [squeezed]))
                logits_name = squeezed
            elem_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(label["dtype"]))
            shape = ["batch", *label["shape"]]
            self.base.graph.input.append(onnx.helper.make_tensor_value_info(label["name"], elem_type, shape))
            # A node's output, not the graph input itself: ORT's loss blocks
            # look for their target among node arguments and add another input otherwise.
            wanted = onnx.TensorProto.INT64 if loss in CLASS_LOSSES else onnx.TensorProto.FLOAT
            target = f"{label['name']}.{onnx.TensorProto.DataType.Name(wanted).lower()}"
            self.base.graph.node.append(onnx.helper.make_node("Cast", [label["name"]], [target], to=wanted))
            return self.inner(logits_name, target)

    return LabelledLoss()


def optimizer_block(optimizer: dict):
    """AdamW as torch.optim.AdamW computes it (ORT's block defaults to the
    Hugging Face variant, adam_mode 1, which puts epsilon and the weight decay
    differently), or plain SGD. No clip_grad: training clips after the all-reduce.
    No weight decay: ORT's operator has one for every parameter, and training
    applies it per group, to the parameters `train.optimizer.no_decay` leaves
    decayed (train/weight_decay.py).
    For LAMB, AdamW's graph too, which training does not run: ORT has no LAMB
    kernel for the CPU, so training steps LAMB itself (training/lamb.py), over the
    same two moments per parameter as AdamW's; the artifacts folder keeps the same
    files for every optimizer."""
    from onnxruntime.training.onnxblock import optim

    if optimizer["name"] == "sgd":
        return optim.SGD()
    return ort_private.torch_adamw_block(tuple(optimizer["betas"]), optimizer["eps"])


def generate(base, trainable, frozen, loss, label, optimizer, out: Path, logits: Logits) -> None:
    """ONNX Runtime's generate_artifacts on the base model: in memory, or (its weights in
    external data) from its file, which ORT's blocks save again as they build, into their
    working folder: `out`, so that nothing lands where the command runs."""
    import onnx
    from onnxruntime.training import artifacts

    quiet_logging()
    # ORT names the nodes it adds from a process-wide counter; restarting it
    # makes the graphs depend on the model alone, byte for byte.
    ort_private.restart_node_names()
    out = out.resolve()  # before the working folder changes
    source = str(Artifacts(out).base_model) if external_data.uses_external_data(base) else base
    try:
        with contextlib.chdir(out):
            artifacts.generate_artifacts(
                source,
                requires_grad=trainable,
                frozen_params=frozen,
                loss=loss_block(loss, label, logits),
                optimizer=optimizer_block(optimizer),
                artifact_directory=out,
                loss_input_names=[logits.name],
                additional_output_names=[logits.name],
            )
    except Exception as error:
        raise explain_generation_error(error, base) from error
    finally:
        gc.collect()  # ORT's blocks remove their saved copies when they are collected
        for scratch in ORT_BLOCK_FILES:
            (out / scratch).unlink(missing_ok=True)
    apply_threshold(Artifacts(out).checkpoint)
    for path in Artifacts(out).graphs:
        if onnx.load(str(path), load_external_data=False).ir_version > 10:
            raise ModelError(f"{path}: written with IR version > 10, which ORT 1.19 refuses; is onnx==1.17 installed?")


def drop_weights(base) -> None:
    """Clear the values of the float initializers of `base` once the checkpoint holds them:
    what follows (the smoke step, FLOPs, model.json) reads their shapes alone, so one
    copy of the weights less is held from here on."""
    for tensor in base.graph.initializer:
        if is_float(tensor):
            for field in ("raw_data", "float_data", "double_data", "int32_data"):  # float16 is in int32_data
                tensor.ClearField(field)


def explain_generation_error(error: Exception, base) -> Exception:
    """Name the operator that has no gradient, if that is what failed."""
    import re

    match = re.search(r"gradient builder has not been registered: (\w+) for node (\S*)", str(error))
    if not match:
        return error
    op, node = match.groups()
    nodes = node or ", ".join(n.name or n.output[0] for n in base.graph.node if n.op_type == op)
    return ModelError(
        f"ONNX Runtime has no gradient for operator {op} (node {nodes}), which lies between a trainable "
        "parameter and the loss; freeze the parameters before it (model.frozen) or replace the operator"
    )


def smoke_step(out: Path, train_dir: Path, manifest: dict) -> float:
    """One forward and backward on the first train records, so that a model
    whose output does not fit the loss fails here, not on the training ranks."""
    from onnxruntime.training import api

    from .data.shards import ShardReader

    quiet_logging()
    reader = ShardReader(train_dir, verify=False)
    batch = reader.gather(np.arange(min(SMOKE_RECORDS, len(reader))))
    files = Artifacts(out)
    state = api.CheckpointState.load_checkpoint(str(files.checkpoint))
    module = api.Module(str(files.training_model), state, str(files.eval_model))
    module.train()
    try:
        # (loss, logits), then BatchNorm's updated running statistics if the model has any
        loss, logits = module(*[batch[name] for name in module.input_names()])[:2]
    except Exception as error:
        raise smoke_step_error(error, batch, manifest, files.base_model) from None
    log.info("one training step on %d train records: loss %.6g, logits %s", SMOKE_RECORDS, float(loss), list(logits.shape))
    return float(loss)


def smoke_step_error(error: Exception, batch: dict, manifest: dict, base_model: Path) -> ModelError:
    """What failed in the smoke step: a node of the backward pass (ONNX Runtime's
    gradient nodes are named `<node>_Grad/...` and `AccumulateGrad_...`), or the
    forward pass and loss, where the model's output most often does not fit the
    label: then both shapes (the output's from running the forward model alone)
    and ONNX Runtime's own words without its source path and C++ signature."""
    import re

    text = str(error).strip()
    label = batch[manifest["label"]["name"]]
    node = re.search(r"running (\w+) node\. Name:'([^']*)' Status Message: (.*)", text)
    if node and ("_Grad/" in node[2] or node[2].startswith("AccumulateGrad")):
        return ModelError(
            f"ONNX Runtime's backward pass fails at its node {node[2]!r} ({node[1]}) on a batch of {len(label)} "
            f"records: {node[3][:300]}; freeze the parameters before that node (model.frozen) or replace the operator "
            "it differentiates"
        )
    status = re.search(r"Status Message: (?:\S+:\d+ [^(]*\([^)]*\) )?(.*)", text)
    try:
        session = inference_session(base_model)
        output = list(session.run(None, {i.name: batch[i.name] for i in session.get_inputs()})[0].shape)
    except Exception:  # the forward model fails on its own: ORT's message below says why
        output = "?"
    return ModelError(
        f"the model's output is {output} and the data's label {manifest['label']['name']!r} is {list(label.shape)} "
        f"on a batch of {len(label)} records, which model.loss cannot take ({(status[1] if status else text)[:300]}); "
        "the logits must be [batch, classes, *label dims] for cross_entropy, the label's shape for the other losses"
    )


def per_sample_values(base) -> dict[str, tuple[list[int], int]]:
    """Name -> (shape, bytes per element) of every value of the forward model whose
    shape is known for a batch of one sample. ONNX Runtime's symbolic shape
    inference follows shapes through Shape, Gather, Concat and Reshape, which torch's
    exporter emits around transformers' Conv1D (a Gemm on the flattened batch) and
    attention (MatMuls of [batch, heads, time, head]); ONNX's own inference loses them there."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = onnx.ModelProto()
    model.CopyFrom(base)
    del model.graph.value_info[:]
    initializers = {t.name for t in model.graph.initializer}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name not in initializers and value.type.tensor_type.shape.dim:
            value.type.tensor_type.shape.dim[0].ClearField("dim_param")
            value.type.tensor_type.shape.dim[0].dim_value = 1
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
        model = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
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
    total, unknown = 0, []
    for node in base.graph.node:
        if node.op_type not in ("MatMul", "Gemm", "Conv"):
            continue
        a, b, y = (values[name][0] if name in values else None for name in (node.input[0], node.input[1], node.output[0]))
        if a is None or b is None or y is None:
            unknown.append(node.name or node.op_type)
        elif node.op_type == "Conv":
            total += 2 * math.prod(y) * math.prod(b[1:])
        elif node.op_type == "Gemm":
            trans_a = next((attr.i for attr in node.attribute if attr.name == "transA"), 0)
            total += 2 * math.prod(y) * (a[0] if trans_a else a[-1])
        else:
            total += 2 * math.prod(y) * a[-1]
    if unknown:
        log.warning("FLOPs leave out %d node(s) whose shapes are not static: %s", len(unknown), unknown[:5])
    return total


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


def embedding_tables(base, trainable: list[str]) -> list[str]:
    """The trainable parameters that an embedding lookup reads: the data input of
    a Gather node, which is what nn.Embedding exports to (for the `<embedding>`
    rule of train.optimizer.no_decay, which then holds whatever the names are)."""
    tables = {node.input[0] for node in base.graph.node if node.op_type == "Gather"}
    return [name for name in trainable if name in tables]


def describe(base, manifest, loss, trainable, frozen, out: Path, kind: str, logits: Logits) -> dict:
    import onnx

    training = onnx.load(str(Artifacts(out).training_model), load_external_data=False)
    sizes = float_initializers(base)
    values = per_sample_values(base)
    forward = forward_flops(base, values)
    batch = batch_values(base, values)
    label = manifest["label"]
    return {
        "kind": kind,
        "task": manifest["task"],
        "loss": loss,
        "num_classes": manifest["num_classes"],
        "inputs": [{"name": f["name"], "dtype": f["dtype"], "shape": ["batch", *f["shape"]]} for f in manifest["features"]],
        "label": {"name": label["name"], "dtype": label["dtype"], "shape": ["batch", *label["shape"]]},
        # The graphs return the loss and the logits; the inference model returns the model's own output,
        # which differs from the logits after a final Softmax (models/logits.py).
        "outputs": {"loss": training.graph.output[0].name, "logits": logits.name,
                    "inference": base.graph.output[0].name},
        "parameters": sum(sizes.values()),
        "trainable_parameters": sum(sizes[n] for n in trainable),
        "trainable": trainable,
        "frozen": frozen,
        "embeddings": embedding_tables(base, trainable),
        # Backward is counted as twice the forward (a gradient for the input and
        # one for the weights per multiply-add), the usual estimate.
        "flops_per_sample": {"forward": forward, "backward": 2 * forward},
        # What training keeps for the backward pass at most, the part of a rank's memory that
        # grows with the micro-batch (preflight.memory_estimate).
        "activation_bytes_per_sample": sum(batch.values()),
        "eval_bytes_per_sample": eval_bytes(base, batch, logits.name),
    }


def build(config: dict, train_dir: Path, out: Path) -> dict:
    train_dir, out = Path(train_dir), Path(out)
    manifest_path = train_dir / "manifest.json"
    if not manifest_path.is_file():
        raise MissingInputError(f"{manifest_path}: no train manifest (run the prepare_data rule first)")
    manifest = json.loads(manifest_path.read_text())
    model = config["model"]
    loss = resolve_loss(model["loss"], manifest)
    with atomic.folder(out) as tmp:
        base, torch_trainable = base_model(model, manifest, loss, config["run"]["seed"], Artifacts(tmp).base_model)
        check_interface(base, manifest)
        vocabulary.check(base, manifest)
        logits = find_logits(base, loss, manifest)
        trainable, frozen = split_parameters(base, model, torch_trainable)
        log.info("model %s, loss %s: %d trainable, %d frozen parameter tensors", model["kind"], loss, len(trainable),
                 len(frozen))
        generate(base, trainable, frozen, loss, manifest["label"], config["train"]["optimizer"], tmp, logits)
        drop_weights(base)
        running_stats = batchnorm.adapt(tmp)
        smoke_step(tmp, train_dir, manifest)
        description = describe(base, manifest, loss, trainable, frozen, tmp, model["kind"], logits) | {
            "running_stats": running_stats
        }
        Artifacts(tmp).model_json.write_text(json.dumps(description, indent=2) + "\n")
    log.info(
        "%d parameters (%d trainable), %d forward FLOPs per sample -> %s",
        description["parameters"],
        description["trainable_parameters"],
        description["flops_per_sample"]["forward"],
        out,
    )
    return description


HELP = "export or load the model and build its training, eval and optimizer graphs and initial checkpoint"


def add_arguments(parser) -> None:
    from .config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--train", required=True, help="the prepared train split (its manifest names the features)")
    parser.add_argument("--out", required=True, help="output folder of the artifacts")


def run(args) -> None:
    from .config import load_config

    build(load_config(args), Path(args.train), Path(args.out))
