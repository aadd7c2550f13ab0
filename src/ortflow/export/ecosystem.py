"""A classifier's, tagger's or regressor's export/optimum/: the model in the ecosystem's layout (issue 41).

export/model.onnx keeps ortflow's layout (the data's feature names as inputs, a tagger's logits
[batch, classes, time]), which every reader of today's exports expects. This folder is what optimum's
ORTModelForSequenceClassification and ORTModelForTokenClassification load as it is, as optimum's own
exporter lays it out: `model.onnx` whose inputs are the tokenizer's input names that the model's
forward takes (input_ids, attention_mask, token_type_ids), `[batch, sequence]`, and whose one output
`logits` is transformers' (`[batch, classes]`, a regressor's `[batch, targets]`, a tagger's
`[batch, sequence, classes]`), beside `config.json` and the tokenizer files of export/transformers/.

It is exported from export/transformers/ as its users load it (AutoModelFor<task>.from_pretrained),
and before it is renamed into place its logits in ONNX Runtime on the eval records, at their length
and at half of it, must be that model's within TOLERANCE. A run of another task (causal LM, seq2seq,
image classification) or kind has no such folder: an earlier run's is removed.
"""

from __future__ import annotations

import inspect
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .. import atomic, external_data
from ..models import LOGITS
from ..models.save_trained import TOKENIZER_OUTPUTS, TRANSFORMERS
from ..user_files import MODEL_CONFIG, TOKENIZER_FILES
from .checks import compare

log = logging.getLogger("ortflow.export")

OPTIMUM = "optimum"  # results/<run>/export/optimum/
MODEL = "model.onnx"  # the file name ORTModel.from_pretrained looks for
# model.task -> optimum's class that loads the folder (for the log and the docs; ortflow does not import optimum)
LOADERS = {"sequence-classification": "ORTModelForSequenceClassification",
           "regression": "ORTModelForSequenceClassification",
           "token-classification": "ORTModelForTokenClassification"}
# LayerNormalization is one operator from opset 17 (generation/decoder.py's OPSET, for the same two runtimes):
# onnxruntime-training 1.19.2 and onnxruntime >= 1.31 load it, at the IR 10 that onnx 1.17 writes.
OPSET = 17


def copy_tokenizer_files(source: Path | None, folder: Path) -> list[str]:
    """The tokenizer files (user_files.TOKENIZER_FILES, not the model's config.json) of the
    save_pretrained folder `source` into `folder`; returns their names (none: no tokenizer)."""
    copied = [name for name in TOKENIZER_FILES
              if name != MODEL_CONFIG and source and (Path(source) / name).is_file()]
    for name in copied:
        shutil.copy2(Path(source) / name, folder / name)
    return copied


def input_names(model, source: Path, batch: dict) -> list[str]:
    """The graph's inputs, in the order of the model's forward: those that the folder's tokenizer gives
    for a text (what optimum's classifiers feed by name), or the data's features where the folder has
    no tokenizer (an .npz of ids), that forward takes."""
    if (source / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        given = set(AutoTokenizer.from_pretrained(source, local_files_only=True)("a text"))
    else:
        given = set(batch)
    return [name for name in inspect.signature(model.forward).parameters if name in TOKENIZER_OUTPUTS and name in given]


def export_logits(model, names: list[str], per_token: bool, path: Path) -> None:
    """`model` (eval mode) as the ONNX model `path`: inputs `names` [batch, sequence] int64, output
    `logits` with transformers' shape; weights added one tensor at a time (torch_export's reason:
    memory), in external data beside it when large."""
    import onnx
    import torch

    from ..models.torch_export import weights_as_initializers

    class Logits(torch.nn.Module):
        """The model between positional tensors (what torch.onnx exports) and its logits."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            return self.model(**dict(zip(names, inputs))).logits

    wrapper = Logits().eval()
    example = tuple(torch.ones(2, 3, dtype=torch.int64) for _ in names)
    axes = {name: {0: "batch", 1: "sequence"} for name in names} | {
        LOGITS: {0: "batch", 1: "sequence"} if per_token else {0: "batch"}}
    with tempfile.TemporaryDirectory(prefix="ortflow-optimum-", dir=path.parent) as scratch, torch.no_grad():
        traced = Path(scratch) / MODEL
        torch.onnx.export(wrapper, example, str(traced), input_names=names, output_names=[LOGITS], dynamic_axes=axes,
                          opset_version=OPSET, dynamo=False, export_params=False,
                          # the weights are not in the graph yet (generation/decoder.py's reason)
                          do_constant_folding=False)
        exported = onnx.load(str(traced))
    weights_as_initializers(exported, wrapper)
    external_data.save_model(exported, path)


def feeds(names: list[str], batch: dict, length: int) -> dict[str, np.ndarray]:
    """The eval records' first `length` positions for each input; token_type_ids of zeros where the
    data have none, as optimum and transformers take a missing one."""
    ids = batch["input_ids"]
    return {name: np.ascontiguousarray(batch[name][:, :length] if name in batch else np.zeros_like(ids[:, :length]),
                                       dtype=np.int64) for name in names}


def check_folder(model, path: Path, names: list[str], batch: dict) -> float:
    """The ONNX model's logits in ONNX Runtime against `model`'s on the eval `batch`, at its length
    and half of it (the sequence is dynamic); returns the largest difference."""
    import torch

    from ..sessions import inference_session

    session = inference_session(path, prepacked=False)  # a check: the weights held once
    worst = 0.0
    for length in sorted({batch["input_ids"].shape[1], max(1, batch["input_ids"].shape[1] // 2)}):
        given = feeds(names, batch, length)
        with torch.no_grad():
            expected = model(**{name: torch.from_numpy(array) for name, array in given.items()}).logits.numpy()
        worst = max(worst, compare(f"{path} at {length} tokens: its logits vs transformers'",
                                   session.run([LOGITS], given)[0], expected))
    return worst


def write_optimum(task: str | None, batch: dict, export: Path) -> None:
    """export/optimum/ from export/transformers/ where `task` (the transformers model's, None for
    another kind) is a text classifier, tagger or regressor, checked on the eval `batch` before it
    is in place; for any other model an earlier run's folder is removed."""
    folder = Path(export) / OPTIMUM
    if task not in LOADERS or "input_ids" not in batch:  # an image classifier has pixels, not token ids
        shutil.rmtree(folder, ignore_errors=True)
        return
    import transformers

    from ..models.hugging_face import CLASSES, PER_TOKEN, attention
    from ..models.save_trained import quietly

    source = Path(export) / TRANSFORMERS
    with quietly():
        kind = transformers.AutoConfig.from_pretrained(source, local_files_only=True).model_type
        model = getattr(transformers, CLASSES[task]).from_pretrained(
            source, local_files_only=True, attn_implementation=attention(kind), dtype="float32").eval()
    names = input_names(model, source, batch)
    with atomic.folder(folder) as building:
        export_logits(model, names, task in PER_TOKEN, building / MODEL)
        shutil.copy2(source / MODEL_CONFIG, building / MODEL_CONFIG)
        copied = copy_tokenizer_files(source, building)
        worst = check_folder(model, building / MODEL, names, batch)
    log.info("%s: %s's folder (inputs %s, logits as transformers gives them; tokenizer %s), its logits on %d eval "
             "records within %.3g of %s's", folder, LOADERS[task], names, ", ".join(copied) or "none",
             len(batch["input_ids"]), worst, type(model).__name__)
