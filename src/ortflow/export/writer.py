"""The inference model written: the inference graph (graphs/inference_model.py: the eval
graph cut down to the model's output, its parameters made initializers holding the merged
checkpoint's weights, written one tensor at a time, where ONNX Runtime's
`Module.export_model_for_inferencing` holds the weights three times). It is the forward
model with the loss stripped, taking the data's features by name and returning the model's
output (the logits, or for a model that ends in a Softmax its probabilities, as the user's
model returned them: models/logits.py), with the batch dimension dynamic, and a text
model's sequence dimension where build_artifacts exported it so (models/torch_export.py).
With `data.standardize` its first nodes standardize its raw features (data/standardize.py).
With `model.lora` (models/lora.py) the trained adapters are merged into its weights and
their branches cut out of its graph.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .. import external_data
from ..artifacts import Artifacts
from ..checkpoints.ort_format import read_ort_checkpoint
from ..data import standardize
from ..graphs import inference_model
from ..graphs.description import ModelDescription
from ..inference import inference_output, set_metadata
from ..models import lora
from ..models.torch_export import add_inputs
from .checks import check_interface

log = logging.getLogger("ortflow.export")


def write_inference_model(files: Artifacts, checkpoint: Path, info: ModelDescription, tmp: Path, out: Path, reader, props: dict,
                          adapted=None) -> None:
    """The inference graph (graphs/inference_model.py: the eval graph cut down to the model's output)
    with the merged `checkpoint`'s weights into `tmp` (in `<out>.data` over
    external_data.threshold()), with the data's standardization in front and `props` as metadata;
    with LoRA, the trained torch module `adapted`'s adapters merged into its weights (lora.fold)."""
    import onnx

    model = inference_model.inference_graph(files.eval_model, inference_output(info))
    weights = read_ort_checkpoint(checkpoint).parameters  # views of the checkpoint's files: not read yet
    if adapted is not None:
        merged = lora.fold(model, adapted)
        log.info("LoRA: the adapters of %d layers merged into their weights", len(merged))
        weights |= merged
    inference_model.add_weights(model, weights, tmp, out)
    del weights
    base = external_data.load_model(files.base_model, load_data=False)
    if inference_output(info) != info.outputs.logits:
        # The eval graph returns the logits; the model's own output keeps the type the model gave it.
        model.graph.output[0].CopyFrom(base.graph.output[0])
    # An input that nothing reads (models/hugging_face.py), which the cut graph drops, as the model had it.
    add_inputs(model, base.graph.input)
    standardize.prepend(model, reader.standardized)
    set_metadata(model, props)
    onnx.save(model, str(tmp))
    check_interface(model, info, out)
