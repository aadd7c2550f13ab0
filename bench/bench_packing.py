"""data.packing's effect: tokens in the loss per step, and the loss, packed against unpacked, on the same chats.

Writes `--rows` chats (bench_chats.write_chats: one to three exchanges, about 100 tokens each) as a
`datasets` folder with train and validation splits (so that every way is scored on the same eval chats),
a byte-level BPE tokenizer with a ChatML template, and a tiny Llama (2 layers, width 64) beside it;
then runs the workflow up to `train` (one rank, AdamW, `--steps` steps of `--batch` records of
data.context `--context`) with data.packing none, separate and cross, and unpacked again for as many
steps as it takes to see as many chats as separate packing saw, and reports for each: records
and their padding, tokens in the loss per step, the step time, and the train and eval losses (the
eval loss is the mean over the eval chats' assistant tokens: with cross, of windows where the chats
see each other).

    python bench/bench_packing.py --rows 4000 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import yaml
from bench_chats import write_chats, write_tokenizer
from bench_quantize import cpu_model  # the CPU's name from /proc/cpuinfo (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
PACKING = ("none", "separate", "cross")


def write_inputs(root: Path, rows: int, vocab: int) -> None:
    import datasets
    import torch
    import transformers

    write_chats(root / "chats.jsonl", rows)
    write_tokenizer(root / "chats.jsonl", root / "model", vocab)
    split = datasets.Dataset.from_json(str(root / "chats.jsonl")).train_test_split(test_size=0.1, seed=0)
    datasets.DatasetDict(train=split["train"], validation=split["test"]).save_to_disk(str(root / "chats"))
    size = len(transformers.AutoTokenizer.from_pretrained(str(root / "model")))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=size, max_position_embeddings=1024)).save_pretrained(root / "model")


def run(root: Path, packing: str, args, steps: int, name: str) -> dict:
    from ortflow.data.shards import ShardReader

    config = {"run": {"name": name},
              "data": {"source": "chats", "tokenizer": "model", "context": args.context, "packing": packing,
                       "too_long": "drop", "shards": 1},
              "model": {"kind": "transformers", "path": "model", "task": "causal-lm"},
              "train": {"world_size": 1, "micro_batch_size": args.batch, "steps": steps,
                        "eval_every": steps, "checkpoint_every": 10**6, "log_every": 10,
                        "optimizer": {"name": "adamw", "lr": 3e-3}}}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    subprocess.run([str(Path(os.sys.executable).parent / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(root),
                    "--configfile", str(root / f"{name}.yaml"), "--cores", "2", "train", "--quiet", "all"],
                   check=True)
    manifest = json.loads((root / f"results/{name}/data/train/manifest.json").read_text())
    examples = manifest["source"]["examples"]
    metrics = json.loads((root / f"results/{name}/train/metrics.json").read_text())
    train = metrics["history"]["train"]
    records = examples.get("windows", examples["examples"])
    reader = ShardReader(root / f"results/{name}/data/train")
    tokens = int(reader.gather(np.arange(len(reader)))["attention_mask"].sum())
    return {"records": records, "examples": examples["examples"],
            "padding": 1 - tokens / (len(reader) * args.context),
            "loss_tokens_per_step": examples["loss_tokens"] / records * args.batch,
            "step_s": metrics["step_time_p50_s"],
            "train_loss": sum(entry["loss"] for entry in train[-5:]) / len(train[-5:]),
            "eval_loss": metrics["history"]["eval"][-1]["loss"], "metrics": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dir", default=None, help="where to work (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        write_inputs(root, args.rows, args.vocab)
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}")
        print(f"{args.rows} chats, data.context {args.context}, {args.batch} records a step, {args.steps} steps")
        print(f"{'data.packing':22} {'records':>7} {'padding':>7} {'loss tokens/step':>16} {'step s':>7} "
              f"{'train loss':>10} {'eval loss':>9}")
        found = {}
        for packing in PACKING:
            found[packing] = run(root, packing, args, args.steps, packing)
        # unpacked for as many examples as separate packing trained on: the same epochs
        steps = round(args.steps * found["none"]["records"] / found["separate"]["records"])
        found[f"none, {steps} steps"] = run(root, "none", args, steps, "none-epochs")
        for name, result in found.items():
            print(f"{name:22} {result['records']:7} {result['padding']:7.1%} {result['loss_tokens_per_step']:16.0f} "
                  f"{result['step_s']:7.3f} {result['train_loss']:10.4f} {result['eval_loss']:9.4f}", flush=True)


if __name__ == "__main__":
    main()
