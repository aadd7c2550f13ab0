"""The layout of the artifacts folder, build_artifacts' output, in one place: the
graph builder writes it; training, export, quantize and the checkpoint tools read it.

    inference_base.onnx   the forward model the graphs are built from
    training_model.onnx   forward, loss and gradients
    eval_model.onnx       forward and loss
    eval_model_bf16.onnx  the same, its multiplies in bfloat16 (train.precision: bf16; graphs/precision.py)
    optimizer_model.onnx  the optimizer step
    checkpoint            the initial weights and optimizer state, in ONNX Runtime's format
    model.json            inputs, label, outputs, loss, parameters and FLOPs (graphs/describe.py; read by
                          graphs/description.py)

With train.pipeline_stages P > 1 (graphs/pipeline.py), beside those (the whole model's,
which export and the checkpoint tools read):

    pipeline.json         the cut: each stage's input, output and its shape, features, parameters
    stage-<s>/            stage s's artifacts, laid out as above, for s in 0 .. P-1

A model over external_data.threshold() has `inference_base.onnx.data` and `checkpoint.data`
beside them (its weights; external_data.py).

ONNX Runtime's generate_artifacts names the graphs and the checkpoint itself; the
names here are its names.
"""

from __future__ import annotations

from pathlib import Path


class Artifacts:
    """The files of the artifacts folder `folder`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.base_model = self.folder / "inference_base.onnx"
        self.training_model = self.folder / "training_model.onnx"
        self.eval_model = self.folder / "eval_model.onnx"
        self.eval_model_bf16 = self.folder / "eval_model_bf16.onnx"
        self.optimizer_model = self.folder / "optimizer_model.onnx"
        self.checkpoint = self.folder / "checkpoint"
        self.model_json = self.folder / "model.json"
        self.pipeline_json = self.folder / "pipeline.json"
        # The three graphs ONNX Runtime's training engine runs.
        self.graphs = (self.training_model, self.eval_model, self.optimizer_model)

    @property
    def bf16(self) -> bool:
        """Built with train.precision: bf16 (graphs/precision.py wrote the rewritten eval graph)."""
        return self.eval_model_bf16.is_file()

    def stage(self, index: int) -> Artifacts:
        """The artifacts of pipeline stage `index`."""
        return Artifacts(self.folder / f"stage-{index}")
