"""ONNX Runtime's training, eval and optimizer graphs and initial checkpoint, generated
from the forward model by `generate_artifacts`."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

from .. import external_data, ort_private
from ..artifacts import Artifacts
from ..checkpoints.ort_format import apply_threshold
from ..errors import ModelError
from ..models import export_fixes, is_float
from ..models.logits import Logits
from ..sessions import quiet_logging
from .loss import loss_block

# What onnxblock's blocks save of a model given by its path, in their working folder (blocks.Block's temp_file_name).
ORT_BLOCK_FILES = ("temp.onnx", "temp.onnx.data")


def optimizer_block(optimizer):
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

    if optimizer.name == "sgd":
        return optim.SGD()
    return ort_private.torch_adamw_block(tuple(optimizer.betas), optimizer.eps)


def generate(base, trainable, frozen, loss, label, optimizer, out: Path, logits: Logits) -> None:
    """The graphs of the whole model: `loss` against the data's label, on the logits."""
    generate_with_loss(base, trainable, frozen, lambda: loss_block(loss, label, logits), logits.name, optimizer, out)


def generate_with_loss(base, requires_grad, frozen, make_loss, loss_input: str, optimizer, out: Path) -> None:
    """ONNX Runtime's generate_artifacts on the base model with the onnxblock `make_loss()` on
    its tensor `loss_input` (which the graphs also return): in memory, or (its weights in
    external data) as the graph of `out`/inference_base.onnx with the weights left in their file,
    which ORT's blocks save again as they build, into their working folder: `out`, so that
    nothing lands where the command runs."""
    import onnx
    from onnxruntime.training import artifacts

    quiet_logging()
    # ORT names the nodes it adds from a process-wide counter; restarting it
    # makes the graphs depend on the model alone, byte for byte.
    ort_private.restart_node_names()
    out = out.resolve()  # before the working folder changes
    # Over the threshold, the graph alone: its initializers point at inference_base.onnx.data in `out`, which
    # ORT then never reads whole (given the file's path, generate_artifacts loads every weight).
    source = (onnx.load(str(Artifacts(out).base_model), load_external_data=False)
              if external_data.uses_external_data(base) else base)
    try:
        with contextlib.chdir(out):
            artifacts.generate_artifacts(
                source,
                requires_grad=requires_grad,
                frozen_params=frozen,
                # Made here: a block saves its work in the folder current when it is made.
                loss=make_loss(),
                optimizer=optimizer_block(optimizer),
                artifact_directory=out,
                loss_input_names=[loss_input],
                additional_output_names=[loss_input],
            )
    except Exception as error:
        raise explain_generation_error(error, base) from error
    finally:
        gc.collect()  # ORT's blocks remove their saved copies when they are collected
        for scratch in ORT_BLOCK_FILES:
            (out / scratch).unlink(missing_ok=True)
    apply_threshold(Artifacts(out).checkpoint)
    export_fixes.keep_padding_rows(Artifacts(out))
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
