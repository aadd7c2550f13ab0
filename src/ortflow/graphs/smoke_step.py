"""One training step on a few train records, so that graphs that do not fit the data
fail in build_artifacts, naming why, not on the training ranks."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..artifacts import Artifacts
from ..data.manifest import Manifest
from ..errors import ModelError
from ..sessions import inference_session, quiet_logging, training_options
from . import precision

log = logging.getLogger("ortflow.build_artifacts")

# Two, so that a model that drops or mixes the batch dimension fails here; no more, since the step
# holds their activations beside the weights and gradients (an 86M GPT: +0.12 GB at 1 record,
# +0.38 GB at 4), and build_artifacts should hold little more than those.
SMOKE_RECORDS = 2


def smoke_step(out: Path, train_dir: Path, manifest: Manifest) -> float:
    """One forward and backward on the first train records, so that a model
    whose output does not fit the loss fails here, not on the training ranks."""
    from onnxruntime.training import api

    from ..data.shards import ShardReader

    quiet_logging()
    reader = ShardReader(train_dir, verify=False)
    batch = reader.gather(np.arange(min(SMOKE_RECORDS, len(reader))))
    files = Artifacts(out)
    state = api.CheckpointState.load_checkpoint(str(files.checkpoint))
    options = training_options()
    # Without ONNX Runtime's arena each of the step's buffers goes back as it dies, where the arena keeps
    # its largest extent (a 554M GPT: 5.19 GiB against 5.25, the same loss; 1 record would hold 5.06, but
    # ONNX Runtime's backward of onnx's light ResNet-50 fails at 2 records and runs at 1).
    options.enable_cpu_mem_arena = False
    training_model, eval_model = precision.module_graphs(files, options)
    module = api.Module(training_model, state, eval_model, session_options=options)
    module.train()
    try:
        # (loss, logits), then BatchNorm's updated running statistics if the model has any
        loss, logits = module(*[batch[name] for name in module.input_names()])[:2]
    except Exception as error:
        raise smoke_step_error(error, batch, manifest, files.base_model) from None
    log.info("one training step on %d train records: loss %.6g, logits %s", SMOKE_RECORDS, float(loss), list(logits.shape))
    return float(loss)


def smoke_step_error(error: Exception, batch: dict, manifest: Manifest, base_model: Path) -> ModelError:
    """What failed in the smoke step: a node of the backward pass (ONNX Runtime's
    gradient nodes are named `<node>_Grad/...` and `AccumulateGrad_...`), or the
    forward pass and loss, where the model's output most often does not fit the
    label: then both shapes (the output's from running the forward model alone)
    and ONNX Runtime's own words without its source path and C++ signature."""
    import re

    text = str(error).strip()
    label = batch[manifest.label.name]
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
        f"the model's output is {output} and the data's label {manifest.label.name!r} is {list(label.shape)} "
        f"on a batch of {len(label)} records, which model.loss cannot take ({(status[1] if status else text)[:300]}); "
        "the logits must be [batch, classes, *label dims] for cross_entropy, the label's shape for the other losses"
    )
