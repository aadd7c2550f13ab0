"""The artifacts' `model.json`, from the forward model and the generated training graph:
what training, export, quantize and the checks before training read of the model
without loading its graphs: its inputs, label and outputs, the loss, its parameters
(trainable, frozen, embedding tables), FLOPs a sample, and the memory a sample takes
in training and evaluation (the part of a rank's memory that grows with the batch,
which preflight.memory_estimate sizes). build_artifacts adds to it the running
statistics, and where the model came from (`transformers`, `lora`)."""

from __future__ import annotations

from pathlib import Path

from ..artifacts import Artifacts
from ..models.logits import Logits
from . import recompute
from .description import Flops, ModelDescription, Outputs, Tensor
from .cost import batch_values, eval_bytes, forward_flops, per_sample_values
from .parameters import embedding_tables, float_initializers


def describe(base, manifest, loss, trainable, frozen, out: Path, kind: str, logits: Logits,
             blocks: list) -> ModelDescription:
    """model.json's description of the forward model `base` of kind `kind`, trained on the data of
    `manifest` with `loss`, from the training graph generated into `out` (with the recomputed
    `blocks`), but for what build_artifacts adds (see above)."""
    import onnx

    training = onnx.load(str(Artifacts(out).training_model), load_external_data=False)
    sizes = float_initializers(base)
    values = per_sample_values(base, manifest)
    forward = forward_flops(base, values)
    batch = batch_values(base, values)
    label = manifest.label
    with_blocks = None if blocks else recompute.activation_bytes_with_blocks(training.graph, batch)
    return ModelDescription(
        kind=kind,
        task=manifest.task,
        loss=loss,
        num_classes=manifest.num_classes,
        inputs=tuple(Tensor(f.name, f.dtype, ("batch", *f.shape)) for f in manifest.features),
        label=Tensor(label.name, label.dtype, ("batch", *label.shape)),
        # The graphs return the loss and the logits; the inference model returns the model's own output,
        # which differs from the logits after a final Softmax (models/logits.py).
        outputs=Outputs(training.graph.output[0].name, logits.name, base.graph.output[0].name),
        parameters=sum(sizes.values()),
        trainable_parameters=sum(sizes[n] for n in trainable),
        trainable=tuple(trainable),
        frozen=tuple(frozen),
        embeddings=tuple(embedding_tables(base, trainable)),
        # Backward is counted as twice the forward (a gradient for the input and
        # one for the weights per multiply-add), the usual estimate.
        flops_per_sample=Flops(forward, 2 * forward),
        # What training keeps for the backward pass at most, the part of a rank's memory that
        # grows with the micro-batch (preflight.memory_estimate); with train.recompute, what
        # the rewritten graph keeps plus the largest block recomputed (graphs/recompute.py).
        activation_bytes_per_sample=recompute.activation_bytes(training.graph, blocks, batch) if blocks
        else sum(batch.values()),
        # Without train.recompute, what `blocks` would make it, for preflight's fixes (None
        # where recompute is on or the model has no blocks).
        activation_bytes_per_sample_recompute_blocks=with_blocks or None,
        eval_bytes_per_sample=eval_bytes(base, batch, logits.name),
    )
