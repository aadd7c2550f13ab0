"""The family matrix of `model.kind: transformers` (issue 30): each family users
fine-tune, at a tiny size (2 layers, width 32), from a save_pretrained folder
made here (nothing downloaded), by its task: encoders as sequence-classification
(BERT also as token-classification, DistilBERT under a token_type_ids feature it
must not be fed), decoders as causal-lm on bytes, T5 and BART as seq2seq on text
pairs, ViT as image-classification.

Each case builds the artifacts (build_artifacts.build), takes STEPS SGD steps
with ONNX Runtime's training API in this process and the same steps in torch
(tests/torch_reference.py: the same TaskModel, initial weights and batches),
compares losses and weights within the layer tests' tolerances, then exports
(export_model.export) and quantizes (quantize_model.quantize) the trained model.
A family ortflow refuses is refused by build, in one line naming why. The
measured differences are docs/models.md's "Families tried"."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import merged_meta
from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.checkpoints.ort_format import read_ort_checkpoint
from ortflow.data.manifest import read_manifest
from ortflow.data.shards import ShardReader
from ortflow.errors import ModelError
from ortflow.evaluation import feeds, outputs_of
from ortflow.models import hugging_face
from ortflow.quantization import measure
from ortflow.stages import build_artifacts, export_model, quantize_model
from ortflow.stages.prepare_data import prepare
from ortflow.training.schedule import learning_rate
from test_torch_layers import LOSS_TOLERANCE, PARAMETER_TOLERANCE, largest
from torch_reference import train_like_ortflow

STEPS = 4
# Plain SGD, not AdamW: the test is of each family's forward and backward, and SGD moves a weight by
# lr x its gradient, so the two trainings' weights part by lr x the gradients' rounding. AdamW
# divides a gradient by the root of its square: where a gradient is near zero (an attention's key
# bias, whose true gradient is zero; the embedding row of a byte absent from the text) it turns the
# rounding noise, which differs with the CPU's summation order, into a step of the learning rate's
# size in either direction (8.5e-6 apart on an Intel Xeon for Qwen2 against a bound of 5e-6). AdamW's
# steps are compared with torch's on the same gradients in tests/test_weight_decay.py and
# tests/test_artifacts.py, and each weight against its own update's size in tests/test_lora.py.
LR = 0.1
VOCAB, TIME, CLASSES = 100, 12, 3
BYTES = 256  # a folder without a tokenizer reads text as bytes: a vocabulary of 256 (causal-lm)
# Sizes every family shares; dropout off, so that both trainings are deterministic.
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
BERT_LIKE = {**SMALL, "vocab_size": VOCAB, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0}
DECODER = {**SMALL, "vocab_size": BYTES, "max_position_embeddings": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "attention_dropout": 0.0}

# family -> (model.task, the transformers config of its tiny model, the data's extra feature)
FAMILIES = {
    "bert": ("sequence-classification", lambda: transformers.BertConfig(**BERT_LIKE)),
    "bert-tokens": ("token-classification", lambda: transformers.BertConfig(**BERT_LIKE)),
    "roberta": ("sequence-classification", lambda: transformers.RobertaConfig(**BERT_LIKE, pad_token_id=0)),
    "distilbert": ("sequence-classification", lambda: transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0)),
    "albert": ("sequence-classification", lambda: transformers.AlbertConfig(
        **BERT_LIKE, embedding_size=16, classifier_dropout_prob=0.0)),
    "electra": ("sequence-classification", lambda: transformers.ElectraConfig(**BERT_LIKE, embedding_size=16)),
    "deberta-v2": ("sequence-classification", lambda: transformers.DebertaV2Config(
        **BERT_LIKE, relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"], pooler_dropout=0.0)),
    "modernbert": ("sequence-classification", lambda: transformers.ModernBertConfig(
        **SMALL, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2, local_attention=8, embedding_dropout=0.0,
        mlp_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0)),
    "gpt2": ("causal-lm", lambda: transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=BYTES, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
    "gpt-neo": ("causal-lm", lambda: transformers.GPTNeoConfig(
        vocab_size=BYTES, max_position_embeddings=64, hidden_size=32, num_layers=2, num_heads=2,
        attention_types=[[["global", "local"], 1]], window_size=8, intermediate_size=64, embed_dropout=0.0,
        attention_dropout=0.0, resid_dropout=0.0)),
    "opt": ("causal-lm", lambda: transformers.OPTConfig(
        vocab_size=BYTES, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0)),
    "llama": ("causal-lm", lambda: transformers.LlamaConfig(**DECODER)),
    "mistral": ("causal-lm", lambda: transformers.MistralConfig(**DECODER, sliding_window=8)),
    "qwen2": ("causal-lm", lambda: transformers.Qwen2Config(**DECODER)),
    "qwen3": ("causal-lm", lambda: transformers.Qwen3Config(**DECODER, head_dim=8)),
    "phi3": ("causal-lm", lambda: transformers.Phi3Config(
        **DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gemma": ("causal-lm", lambda: transformers.GemmaConfig(**DECODER, head_dim=8)),
    "falcon": ("causal-lm", lambda: transformers.FalconConfig(
        vocab_size=BYTES, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, alibi=False, attention_dropout=0.0, hidden_dropout=0.0)),
    "falcon-alibi": ("causal-lm", lambda: transformers.FalconConfig(
        vocab_size=BYTES, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, alibi=True, attention_dropout=0.0, hidden_dropout=0.0)),
    # Sequence to sequence, on source and target texts with a WordPiece tokenizer ([PAD] 0, [SEP] 3).
    "t5": ("seq2seq", lambda: transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=3, decoder_start_token_id=0)),
    "bart": ("seq2seq", lambda: transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=3)),
    "vit": ("image-classification", lambda: transformers.ViTConfig(
        **SMALL, image_size=16, patch_size=4, num_channels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
}
# The tokenizer of DistilBERT's data gives token_type_ids, which DistilBERT's forward does not take.
TOKEN_TYPES = {"distilbert"}
# Families build refuses, by the line it says.
REFUSED = {
    "falcon-alibi": r"^model.path: \S+ is a falcon model with alibi=True, which ortflow cannot train: its ALiBi bias "
                    r"is computed in bfloat16, which torch.onnx writes as a Cast to ONNX type 15 \(complex128",
}


def write_data(family: str, task: str, root: Path) -> dict:
    """The family's data in `root` and the data config that reads it."""
    rng = np.random.default_rng(0)
    n = 64
    if task == "causal-lm":
        (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
        return {"source": str(root / "corpus.txt"), "context": TIME}
    if task == "seq2seq":  # the target is the source's words in reverse order
        from text_models import train_wordpiece

        words = "red green blue cat dog bird runs sleeps eats big small old new fast slow".split()
        sources = [" ".join(rng.choice(words, rng.integers(3, 8))) for _ in range(n)]
        targets = [" ".join(reversed(source.split())) for source in sources]
        with (root / "pairs.jsonl").open("w") as file:
            file.writelines(json.dumps({"source": s, "target": t}) + "\n" for s, t in zip(sources, targets))
        train_wordpiece(root / "tokenizer.json", VOCAB, sources)
        return {"source": str(root / "pairs.jsonl"), "text": "source", "label": "target",
                "tokenizer": str(root / "tokenizer.json"), "context": TIME}
    if task == "image-classification":
        np.savez(root / "images.npz", pixel_values=rng.normal(size=(n, 3, 16, 16)).astype(np.float32),
                 y=rng.integers(0, CLASSES, n))
        return {"source": str(root / "images.npz"), "features": ["pixel_values"]}
    # Token ids 3.. (0 is padding, after a random length, with attention mask 0; 1 and 2 special).
    ids = rng.integers(3, VOCAB, (n, TIME))
    mask = np.arange(TIME)[None, :] < rng.integers(TIME // 2, TIME + 1, n)[:, None]
    arrays = {"input_ids": np.where(mask, ids, 0), "attention_mask": mask.astype(np.int64)}
    if family in TOKEN_TYPES:
        arrays["token_type_ids"] = np.zeros((n, TIME), np.int64)
    labels = rng.integers(0, CLASSES, (n, TIME) if task == "token-classification" else n)
    np.savez(root / "tokens.npz", **arrays, y=labels)
    return {"source": str(root / "tokens.npz"), "features": list(arrays)}


def family_config(name: str, model: dict, family: str, root: Path, train: dict) -> config_mod.Config:
    """The config of run `name` training `model` on `family`'s data in `root`, one rank of 8 records
    a step, STEPS steps unless `train` says otherwise; a `kind: transformers` model from the
    family's tiny model, saved by save_pretrained into root/folder (torch's seed 0)."""
    task, make = FAMILIES[family]
    if model["kind"] == "transformers":
        torch.manual_seed(0)
        getattr(transformers, hugging_face.CLASSES[task]).from_config(make()).save_pretrained(root / "folder")
        model = {**model, "path": str(root / "folder")}
    return config_mod.load(overrides={
        "run": {"name": name, "seed": 3},
        "data": {**write_data(family, task, root), "shards": 1, "eval_fraction": 0.25},
        "model": model,
        "train": {"world_size": 1, "micro_batch_size": 8, "steps": STEPS, "clip_grad_norm": None, **train},
    })


def train_in_ort(artifacts: Artifacts, config: config_mod.Config, train_dir: Path, checkpoint: Path) -> list[float]:
    """ortflow's training on one rank, in this process: the artifacts' graphs under
    ONNX Runtime's training API (whose Optimizer equals ortflow's optimizer step bit for
    bit: tests/test_optimizer.py), the same global batches and schedule as
    torch_reference; the trained state saved as a merged checkpoint. Artifacts built at
    train.precision bf16 open as training opens them (precision.module_graphs)."""
    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from ortflow.graphs import precision

    train, opt = config.train, config.train.optimizer
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    options = ort.SessionOptions()  # what Module takes when given none
    training, evaluation = precision.module_graphs(artifacts, options)
    module = Module(training, state, evaluation, session_options=options)
    optimizer = Optimizer(str(artifacts.optimizer_model), module)
    reader = ShardReader(train_dir)
    module.train()
    losses = []
    for step in range(train.steps):
        optimizer.set_learning_rate(learning_rate(step, train.steps, opt.lr, train.lr_schedule))
        indices = reader.global_batch(step, config.run.seed, config_mod.global_batch_size(config))
        batch = reader.gather(np.sort(indices))
        loss, _ = outputs_of(module(*feeds(batch, module.input_names(), reader.label_name, reader.label_name)))
        optimizer.step()
        module.lazy_reset_grad()
        losses.append(loss)
    checkpoint.mkdir()
    # With the moments, as merge_checkpoint writes a run's.
    CheckpointState.save_checkpoint(state, str(checkpoint / "checkpoint"), include_optimizer_state=True)
    merged_meta(checkpoint, train.steps, "test")
    return losses


def differences(trained: dict, reference: dict) -> dict:
    """{name: the largest difference of its elements} of every parameter."""
    return {name: largest(array, reference[name]) for name, array in trained.items()}


def torch_twin(config: config_mod.Config, manifest: dict, initial: dict) -> torch.nn.Module:
    """The TaskModel that build exported, with the initial checkpoint's weights (a head
    tied to the embedding is one initializer there, and stays tied here)."""
    model = hugging_face.build(config.model, manifest)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()}, strict=False)
    tied = {name for name in missing if model.state_dict()[name].data_ptr() in
            {p.data_ptr() for n, p in model.state_dict().items() if n in initial}}
    assert not unexpected and set(missing) == tied, (missing, unexpected)
    return model


# One family of each task, and each that needs one of ortflow's fixes or is refused, in the fast loop;
# the other families (seconds each, minutes together) with the end-to-end tests.
FAST = {"bert", "bert-tokens", "distilbert", "modernbert", "gpt2", "falcon", "falcon-alibi", "vit"}


@pytest.mark.parametrize("family", [family if family in FAST else pytest.param(family, marks=pytest.mark.e2e)
                                    for family in FAMILIES])
def test_family_trains_like_torch_exports_and_quantizes(family, tmp_path, monkeypatch):
    task, make_config = FAMILIES[family]
    torch.manual_seed(0)
    hf_class = getattr(transformers, hugging_face.CLASSES[task])
    hf_class.from_config(make_config()).save_pretrained(tmp_path / "folder")
    config = config_mod.load(overrides={
        "run": {"name": family, "seed": 3},
        "data": {**write_data(family, task, tmp_path), "shards": 1, "eval_fraction": 0.25},
        "model": {"kind": "transformers", "path": str(tmp_path / "folder"), "task": task},
        "train": {"world_size": 1, "micro_batch_size": 8, "steps": STEPS, "clip_grad_norm": None,
                  "optimizer": {"name": "sgd", "lr": LR, "weight_decay": 0.0},
                  "lr_schedule": {"name": "cosine", "warmup_steps": 2}},
    })
    train_dir, eval_dir = tmp_path / "data/train", tmp_path / "data/eval"
    prepare(config, train_dir, eval_dir)
    artifacts = Artifacts(tmp_path / "artifacts")
    if family in REFUSED:
        with pytest.raises(ModelError, match=REFUSED[family]) as refusal:
            build_artifacts.build(config, train_dir, artifacts.folder)
        assert "\n" not in str(refusal.value) and not artifacts.folder.exists()
        return
    build_artifacts.build(config, train_dir, artifacts.folder)

    initial = dict(read_ort_checkpoint(artifacts.checkpoint).parameters)
    losses = train_in_ort(artifacts, config, train_dir, tmp_path / "checkpoint")
    trained = dict(read_ort_checkpoint(tmp_path / "checkpoint/checkpoint").parameters)
    manifest = read_manifest(train_dir)
    twin = torch_twin(config, manifest, initial)
    implementation = twin.model.config._attn_implementation
    assert implementation == hugging_face.attention(twin.model.config.model_type), implementation
    torch_losses, torch_trained = train_like_ortflow(twin, config, train_dir)
    worst = differences(trained, torch_trained)
    print(f"{family} ({implementation}): loss {largest(losses, torch_losses):.2g}, parameters "
          f"{max(worst.values()):.2g} ({max(worst, key=worst.get)})")
    # float32 rounds relative to a value's size: the layer tests' limit is for losses near 1,
    # a language model's on bytes starts at ln 256 = 5.5.
    assert largest(losses, torch_losses) <= LOSS_TOLERANCE * max(1.0, *torch_losses), (losses, torch_losses)
    assert max(worst.values()) <= PARAMETER_TOLERANCE, worst
    assert max(largest(trained[name], initial[name]) for name in trained) > 100 * PARAMETER_TOLERANCE  # it trained

    monkeypatch.setattr(measure, "LATENCY_BUDGET_S", 0.1)  # timing is not what this test is about
    export_model.export(config, artifacts.folder, tmp_path / "checkpoint", eval_dir, tmp_path / "model.onnx")
    (tmp_path / "generation-int4").mkdir()  # an earlier run's: export.int4 is null here, so it goes
    report = quantize_model.quantize(config, tmp_path / "model.onnx", artifacts.folder, eval_dir,
                                     tmp_path / "model.int8.onnx", tmp_path / "metrics.json",
                                     tmp_path / "generation", tmp_path / "generation-int4")
    assert (tmp_path / "model.int8.onnx").is_file() and report.quantize in ("dynamic", "static"), report
    assert not (tmp_path / "generation-int4").exists() and report.int4 is None
    assert np.isfinite(report.int8["loss"]), report
