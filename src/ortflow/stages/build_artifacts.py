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
   statistics, and the eval graph normalizes with them (batchnorm.py). With
   `train.recompute`, the training graph is then rewritten so that the blocks'
   forward is computed again in the backward (graphs/recompute.py). With
   `train.precision: bf16` the training graph's matrix multiplies are then rewritten
   to ortflow's bfloat16 operator, and the eval graph's into `eval_model_bf16.onnx`
   beside it (graphs/precision.py).
3. `model.json` describes the inputs, label, outputs, parameters and FLOPs
   (graphs/describe.py), and the running statistics (`running_stats`: training
   graph output -> parameter); for `kind: transformers` where the model came from
   (`transformers`: its class, task, and the tensors of a new head drawn from
   run.seed), and with `model.lora` its adapters (`lora`: r, alpha, dropout and
   the target layers; models/lora.py).
4. One training step on a few train records proves that the graphs fit the data.

With train.pipeline_stages P > 1, the model is also cut into P stages balanced by their
parameters, and each stage's graphs and checkpoint are built into `stage-<s>/`, the cut
into `pipeline.json` (graphs/pipeline.py, artifacts.py); the whole model's stay, for
model.json, export and the checkpoint tools.

Everything is written to `<out>.tmp` and renamed to `<out>` when complete (atomic.folder).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from pathlib import Path

from .. import atomic
from ..artifacts import Artifacts
from ..config import Config
from ..data.manifest import MANIFEST, read_manifest
from ..errors import MissingInputError
from ..graphs import pipeline, precision, recompute
from ..graphs.describe import describe
from ..graphs.description import ModelDescription, write_description
from ..graphs.forward_model import base_model, check_interface
from ..graphs.generate import drop_weights, generate
from ..graphs.loss import resolve_loss
from ..graphs.parameters import split_parameters
from ..graphs.smoke_step import smoke_step
from ..models import batchnorm, vocabulary
from ..models.logits import find as find_logits
from ..reporting.results import lora_trained

log = logging.getLogger("ortflow.build_artifacts")


def build(config: Config, train_dir: Path, out: Path) -> ModelDescription:
    # Imported first here, where nothing large is alive: onnxruntime's first import keeps the
    # traceback of an ImportError it handles (ORTModule's missing torch extensions), and with it
    # every frame of the import's callers, which held the exported torch module (W) to the end.
    importlib.import_module("onnxruntime")

    train_dir, out = Path(train_dir), Path(out)
    if not (train_dir / MANIFEST).is_file():
        raise MissingInputError(f"{train_dir / MANIFEST}: no train manifest (run the prepare_data rule first)")
    manifest = read_manifest(train_dir)
    model = config.model
    loss = resolve_loss(model.loss, manifest, model.task if model.kind == "transformers" else None)
    with atomic.folder(out) as tmp:
        base, torch_trainable, described = base_model(model, manifest, loss, config.run.seed,
                                                      Artifacts(tmp).base_model)
        check_interface(base, manifest)
        vocabulary.check(base, manifest)
        logits = find_logits(base, loss, manifest)
        trainable, frozen = split_parameters(base, model, torch_trainable)
        log.info("model %s, loss %s: %d trainable, %d frozen parameter tensors", model.kind, loss, len(trainable),
                 len(frozen))
        generate(base, trainable, frozen, loss, manifest.label, config.train.optimizer, tmp, logits)
        blocks = recompute.apply(Artifacts(tmp).training_model, config.train.recompute)
        if blocks:
            log.info("train.recompute: %d block(s) recomputed in the backward (%s ...)", len(blocks), blocks[0].name)
        # After recompute, so that the recomputed blocks' copies multiply in bfloat16 too.
        rewritten = precision.apply(tmp, config.train.precision)
        if rewritten:
            log.info("train.precision bf16: %d multiplies of the training graph and %d of the eval graph computed "
                     "in bfloat16 (ortflow.BF16MatMul)", rewritten["training"], rewritten["eval"])
        if config.train.pipeline_stages > 1:  # from the weights, which drop_weights clears
            plan = pipeline.cut(base, config.train.pipeline_stages, manifest=manifest)
            for stage in pipeline.build(plan, trainable, loss, manifest.label, config.train.optimizer, tmp, logits):
                # Each stage's own training graph recomputes those of the whole model's blocks it holds.
                if blocks:
                    held = recompute.apply(Artifacts(stage).training_model, [b.name for b in blocks], every_item=False)
                    log.info("train.recompute: %d block(s) recomputed in %s", len(held), stage.name)
                precision.apply(stage, config.train.precision)
        drop_weights(base)
        running_stats = batchnorm.adapt(tmp)
        description = dataclasses.replace(
            describe(base, manifest, loss, trainable, frozen, tmp, model.kind, logits, blocks),
            running_stats=running_stats,
            bf16_matmuls=rewritten,  # the multiplies rewritten to bfloat16 in each graph ({} at fp32; graphs/precision.py)
            **described)
        # Last: what ONNX Runtime's step held (the weights, their gradients) stays partly in the
        # process, and the shape inferences of describe() would come on top of it.
        smoke_step(tmp, train_dir, manifest)
        write_description(Artifacts(tmp).model_json, description)
    log.info(
        "%d parameters (%d trainable), %d forward FLOPs per sample -> %s",
        description.parameters,
        description.trainable_parameters,
        description.flops_per_sample.forward,
        out,
    )
    if description.lora:
        log.info("%s", lora_trained(description))
    return description


# The config keys this stage reads, which its rule passes (stages/__init__.py), the data aside (its
# manifest): the graphs bake in the optimizer's name, betas and eps, train.recompute's copies,
# train.precision's bfloat16 multiplies and train.pipeline_stages' stages; the learning rate and the
# weight decay are training's, so the other train.* keys do not rebuild the artifacts.
KEYS = ("run.seed", "model", "train.optimizer.name", "train.optimizer.betas", "train.optimizer.eps",
        "train.recompute", "train.precision", "train.pipeline_stages")
HELP = "export or load the model and build its training, eval and optimizer graphs and initial checkpoint"


def add_arguments(parser) -> None:
    from ..config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--train", required=True, help="the prepared train split (its manifest names the features)")
    parser.add_argument("--out", required=True, help="output folder of the artifacts")


def run(args) -> None:
    from ..config import load_config

    build(load_config(args), Path(args.train), Path(args.out))
