"""export/optimum/ (export/ecosystem.py): a text classifier's, tagger's and regressor's model in the
layout optimum's ORTModelFor<task> loads, checked here in ONNX Runtime 1.19.2 (this project's runtime)
against transformers' logits of export/transformers/ on the same tokenized batch: the inputs are
named as the tokenizer gives them (or the data's features, without a tokenizer), the logits are
transformers' shape, the tokenizer and config.json lie beside it, at opset 17. Loading the folders
in optimum itself (another environment) is tests/test_serving_venv.py's.

The stages run as functions on tiny BERTs (test_save_trained.exported), no training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from ortflow.models import IGNORE_INDEX
from ortflow.reporting.summary import run_summary
from test_save_trained import CONTEXT, animal_classifier, eval_records, exported
from transformers_models import save_bert

VOCAB = 20


def tokens(work: Path, label: np.ndarray, name: str) -> Path:
    """An .npz of 64 rows of token ids padded with 0 after a random length, their attention mask,
    and `label` as `name` (a tagger's: -100 on the padding): data without a tokenizer, as an .npz of ids
    gives them."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (len(label), CONTEXT))
    padding = np.arange(CONTEXT)[None, :] >= rng.integers(3, CONTEXT + 1, len(ids))[:, None]
    ids[padding] = 0
    if label.ndim == 2:
        label[padding] = IGNORE_INDEX
    np.savez(work / "tokens.npz", input_ids=ids, attention_mask=(~padding).astype(np.int64), **{name: label})
    return work / "tokens.npz"


def tagger(work: Path) -> Path:
    """A BERT tagger of 4 classes (token-classification) on ids with tags per token, -100 on the padding."""
    source = tokens(work, np.random.default_rng(1).integers(0, 4, (64, CONTEXT)), "tags")
    return exported(work, {"source": str(source), "features": ["input_ids", "attention_mask"], "label": "tags"},
                    {"kind": "transformers", "path": str(save_bert(work / "bert", VOCAB)),
                     "task": "token-classification"})


def regressor(work: Path) -> Path:
    """A BERT regressor (task regression: one float target) on ids."""
    source = tokens(work, np.random.default_rng(1).standard_normal(64).astype(np.float32), "y")
    return exported(work, {"source": str(source), "features": ["input_ids", "attention_mask"], "label": "y"},
                    {"kind": "transformers", "path": str(save_bert(work / "bert", VOCAB)), "task": "regression"})


def dims(model: onnx.ModelProto) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.input, *model.graph.output]}


def transformers_logits(export: Path, task_class: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import transformers

    model = getattr(transformers, task_class).from_pretrained(export / "transformers").eval()
    with torch.no_grad():
        return model(**{name: torch.from_numpy(array) for name, array in feeds.items()}).logits.numpy()


def contract(export: Path) -> tuple[onnx.ModelProto, onnxruntime.InferenceSession]:
    """The folder's model, opset 17 (what onnxruntime 1.19.2 and >= 1.31 both load), and a 1.19.2 session of it."""
    model = onnx.load(str(export / "optimum/model.onnx"))
    assert [(o.domain, o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")] == [("", 17)]
    assert model.ir_version <= 10 and onnxruntime.__version__ == "1.19.2"
    return model, onnxruntime.InferenceSession(str(export / "optimum/model.onnx"), providers=["CPUExecutionProvider"])


def test_classifier_takes_what_its_tokenizer_gives(tmp_path):
    """A BERT classifier on WordPiece-tokenized texts: the folder holds model.onnx, config.json (its
    labels) and the tokenizer; the tokenizer's output for a batch of eval texts, padded to the longest
    (not data.context), goes into the model as it is, and its logits [batch, 3] are transformers'. The
    end-of-run summary names the folder and the class that loads it."""
    from transformers import AutoTokenizer

    export, frame = animal_classifier(tmp_path)
    folder = export / "optimum"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.onnx", "tokenizer.json",
                                                        "tokenizer_config.json"]
    assert json.loads((folder / "config.json").read_text())["id2label"] == {"0": "cat", "1": "cow", "2": "dog"}
    # transformers 4 (optimum's pin) loads the tokenizer by this class name; it does not know transformers 5's own
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    model, session = contract(export)
    assert dims(model) == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                           "token_type_ids": ["batch", "sequence"], "logits": ["batch", 3]}

    texts = ["the woof said it", "the moo said loud here was it it loud"]
    batch = dict(AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="np"))
    assert batch["input_ids"].shape[1] != CONTEXT and batch["attention_mask"].min() == 0
    # The type ids that BERT's template gives a pair (1 for the second text), as the data's tokenization did.
    assert AutoTokenizer.from_pretrained(folder)("the cat", "said it")["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]
    logits = session.run(None, batch)[0]
    expected = transformers_logits(export, "AutoModelForSequenceClassification", batch)
    assert logits.shape == (2, 3) and np.abs(logits - expected).max() < 1e-4 * np.abs(expected).max() + 1e-6

    lines = run_summary(tmp_path, train_metrics=tmp_path / "none", export_metrics=tmp_path / "none",
                        model=export / "model.onnx", int8=tmp_path / "none", checkpoint=tmp_path / "none",
                        report=tmp_path / "report.html").splitlines()
    assert (f"  optimum   {folder} (ORTModelForSequenceClassification.from_pretrained: the tokenizer's inputs, "
            "transformers' logits)") in lines


@pytest.mark.parametrize(("build", "task_class", "shape"), [
    (tagger, "AutoModelForTokenClassification", ["batch", "sequence", 4]),
    (regressor, "AutoModelForSequenceClassification", ["batch", 1])], ids=["tagger", "regressor"])
def test_tagger_and_regressor_give_transformers_logits(tmp_path, build, task_class, shape):
    """Without a tokenizer the inputs are the data's features; a tagger's logits are [batch, sequence,
    classes] (export/model.onnx keeps ortflow's [batch, classes, sequence]), a regressor's [batch, 1]."""
    export = build(tmp_path)
    assert sorted(p.name for p in (export / "optimum").iterdir()) == ["config.json", "model.onnx"]
    model, session = contract(export)
    assert dims(model) == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                           "logits": shape}
    records = eval_records(tmp_path)
    feeds = {name: records[name] for name in ("input_ids", "attention_mask")}
    logits = session.run(None, feeds)[0]
    expected = transformers_logits(export, task_class, feeds)
    assert logits.shape == expected.shape and np.abs(logits - expected).max() < 1e-4 * np.abs(expected).max() + 1e-6
    if shape[1] == "sequence":  # today's export is unchanged: the same logits, classes before time
        old = onnxruntime.InferenceSession(str(export / "model.onnx")).run(None, feeds)[0]
        assert old.shape == (len(logits), 4, CONTEXT)
        assert np.abs(old.transpose(0, 2, 1) - logits).max() < 1e-4 * np.abs(logits).max() + 1e-6
