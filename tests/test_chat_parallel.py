"""Chats downstream (issue 42): the settings that change how a model is trained take chat data as they
take text. A tiny Llama chat model with LoRA, packed examples (their attention masks and position ids
go to every pipeline stage that needs them) and 2 pipeline stages through the workflow, against one
rank accumulating the same micro-batches; a sweep's points over the chat data's keys each prepare
their own data."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import BIN, run_snakemake
from ortflow import config as config_mod
from ortflow.sweeps import points as sweeps
from ortflow.checkpoints import reader, resume
from ortflow.stages import build_artifacts
from text_models import CHAT_WORDS, MARKED_TEMPLATE, chat_tokenizer

# The pipeline's own tests find the stages' weights bit for bit those of 1 rank; this bound leaves
# room for a summation order only (SGD: no optimizer amplifies the rounding).
TOLERANCE = 1e-6


def chat_config(workdir: Path, weights: bool = True) -> dict:
    """A tiny Llama with a chat template (without `weights`, its tokenizer alone) and 60 chats in
    `workdir`; the run's config (LoRA, packed, 2 pipeline stages of 1 copy, 2 micro-batches of 4
    accumulated, SGD)."""
    rng = np.random.default_rng(0)
    words = CHAT_WORDS[8:]
    rows = [{"messages": [{"role": "user", "content": " ".join(rng.choice(words, rng.integers(2, 6)))},
                          {"role": "assistant", "content": " ".join(rng.choice(words, rng.integers(1, 5)))}]}
            for _ in range(60)]
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    folder = chat_tokenizer(workdir / "model")
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=len(CHAT_WORDS), max_position_embeddings=64,
            attention_dropout=0.0)).save_pretrained(folder)
    return {
        "run": {"name": "chat"},
        "data": {"source": "chats.jsonl", "tokenizer": "model", "context": 16, "shards": 1, "eval_fraction": 0.25,
                 "chat_template": MARKED_TEMPLATE, "packing": "separate"},
        "model": {"kind": "transformers", "path": "model", "task": "causal-lm", "lora": {"r": 4, "alpha": 8}},
        "train": {"world_size": 2, "pipeline_stages": 2, "grad_accum_steps": 2, "micro_batch_size": 4,
                  "steps": 4, "log_every": 1, "eval_every": 4, "checkpoint_every": 4, "clip_grad_norm": None,
                  "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}},
    }


def final_weights(train_dir: Path) -> dict[str, np.ndarray]:
    return reader.load_parameters(resume.latest(train_dir / "checkpoints").path)


@pytest.mark.e2e
def test_lora_on_packed_chats_in_pipeline_stages_trains_as_one_rank_and_exports(tmp_path, monkeypatch):
    workdir = tmp_path / "work"
    overrides = chat_config(workdir)
    run_snakemake(workdir, overrides, "export_model")
    results = workdir / "results/chat"
    log = (workdir / "logs/chat/train.log").read_text()
    assert "global batch 8 (4 x 2 accumulated x 1 copy of 2 stages)" in log, log

    # One rank accumulating the same micro-batches, from the same initial weights (the unstaged graphs).
    monkeypatch.chdir(workdir)  # the config's files are relative to the workdir, as in the run
    one_rank = {**overrides, "train": {**overrides["train"], "world_size": 1, "pipeline_stages": 1}}
    config = config_mod.load(overrides=one_rank)
    build_artifacts.build(config, results / "data/train", tmp_path / "one-rank/artifacts")
    subprocess.run(
        [str(BIN / "ortflow"), "train", "--config-json", json.dumps(config_mod.as_dict(config)),
         "--train", str(results / "data/train"), "--eval", str(results / "data/eval"),
         "--artifacts", str(tmp_path / "one-rank/artifacts"), "--out", str(tmp_path / "one-rank/train")],
        check=True, capture_output=True, text=True,
    )
    staged, alone = final_weights(results / "train"), final_weights(tmp_path / "one-rank/train")
    assert staged.keys() == alone.keys() and any(".lora_" in name for name in staged), sorted(staged)
    assert max(float(np.max(np.abs(staged[name] - alone[name]))) for name in staged) <= TOLERANCE
    runs = [json.loads((folder / "metrics.json").read_text()) for folder in (results / "train",
                                                                           tmp_path / "one-rank/train")]
    losses = [[entry["loss"] for entry in run["history"]["train"]] for run in runs]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], abs=TOLERANCE), losses
    assert runs[0]["eval"]["loss"] == pytest.approx(runs[1]["eval"]["loss"], abs=TOLERANCE)

    # The adapters merged into the exported folder, which renders chats with the run's template.
    exported = results / "export/transformers"
    assert transformers.AutoTokenizer.from_pretrained(str(exported)).chat_template == MARKED_TEMPLATE
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    assert not [name for name, _ in merged.named_parameters() if "lora" in name]


def test_a_sweep_over_the_chat_datas_keys_prepares_each_points_data(tmp_path, monkeypatch):
    """data.loss_on and data.packing change the records: each point has shards of its own, and the
    points that differ only in training share theirs."""
    monkeypatch.chdir(tmp_path)
    overrides = chat_config(tmp_path, weights=False)
    grid = {"data.loss_on": ["assistant", "all"], "data.packing": ["none", "separate"],
            "train.optimizer.lr": [0.1, 0.2]}
    config = config_mod.load(overrides={**overrides, "sweep": {"name": "chat", "grid": grid}})
    points = sweeps.points(config)
    data = {point.name: sweeps.shared(point.config, "data", ("data",)) for point in points}
    assert len(points) == 8 and len(set(data.values())) == 4, data
    for point in points:
        same_data = {name for name in data if data[name] == data[point.name]}
        assert len(same_data) == 2 and all(name.split("lr-")[0] == point.name.split("lr-")[0]
                                           for name in same_data), (point.name, same_data)
