"""Activation recomputation (`train.recompute: blocks`): one rank's peak RSS and step time
with and without it, under ONNX Runtime's session options that decide whether freed memory
is reused (enable_mem_reuse, execution_order), against Hugging Face's
gradient_checkpointing_enable() with torch on the same model, batch and thread count, in
the same run. The model is transformers' GPT-2 (a language model on text) or BERT (a
sequence classifier on token ids and their attention mask) through
tests/transformers_models.py's wrappers, Dropout on, AdamW. Each measurement runs in a process of its own,
one thread, its peak RSS its own (VmHWM, reset when it starts); the best step time of the steps after the
first two is kept (the least disturbed by whatever else the machine runs).

    python bench/bench_recompute.py [--model gpt2] [--layers 4] [--width 256] [--context 256] [--batch 8]
                                    [--steps 6] [--vocab 256]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WARMUP = 2
# (label, train.recompute, enable_mem_reuse, execution_order)
ORTFLOW = [
    (f"ortflow, {name}, {label}", recompute, reuse, order)
    for name, recompute in (("no recompute", "none"), ("recompute blocks", "blocks"))
    for label, reuse, order in (("ORT's default options", True, "DEFAULT"), ("mem_reuse off", False, "DEFAULT"),
                                ("PRIORITY_BASED", True, "PRIORITY_BASED"),
                                ("mem_reuse off + PRIORITY_BASED", False, "PRIORITY_BASED"))
]
TORCH = [("torch, no checkpointing", False), ("torch, gradient_checkpointing_enable()", True)]
WRAPPERS = {"gpt2": "GPT2", "bert": "BertClassifier"}  # tests/transformers_models.py
FEATURES = {"gpt2": ["x"], "bert": ["input_ids", "attention_mask"]}  # the label is y


def model_kwargs(args) -> dict:
    """The wrapper's arguments: GPT2Config's or BertConfig's shape from --layers, --width, --vocab."""
    if args.model == "gpt2":
        return {"n_layer": args.layers, "n_embd": args.width, "n_head": args.width // 64, "context": args.context,
                "vocab_size": args.vocab}
    return {"layers": args.layers, "hidden_size": args.width, "heads": args.width // 64,
            "intermediate_size": 4 * args.width, "max_position_embeddings": 512, "vocab_size": args.vocab}


def build(folder: Path, args) -> tuple[Path, Path]:
    """The data and the artifacts of the model (train.recompute none and blocks)."""
    sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]
    from ortflow import config as config_mod
    from ortflow.graphs import recompute
    from ortflow.stages import build_artifacts
    from ortflow.stages.prepare_data import prepare
    from test_transformers import marked_sequences

    if args.model == "gpt2":
        data = {"source": str(folder / "corpus.txt"), "context": args.context}
        (folder / "corpus.txt").write_text(" ".join(f"word{i % 97} text{i % 13}." for i in range(40_000)))
    else:
        data = {"source": str(folder / "marked.npz"), "features": FEATURES["bert"]}
        marked_sequences(folder / "marked.npz", n=400, length=args.context, vocab=args.vocab)
    config = config_mod.load(overrides={"data": data, "model": {
        "kind": "torch", "path": f"transformers_models:{WRAPPERS[args.model]}", "kwargs": model_kwargs(args)}})
    prepare(config, folder / "train", folder / "eval")
    build_artifacts.build(config, folder / "train", folder / "none")
    shutil.copytree(folder / "none", folder / "blocks")
    recompute.apply(folder / "blocks" / "training_model.onnx", "blocks")
    return folder / "train", folder


def rss_mib(field: str = "VmRSS") -> float:
    """This process's RSS now (VmRSS) or its peak since `reset_peak` (VmHWM; ru_maxrss would
    carry the parent's peak over fork and exec, and the parent built the artifacts)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status[field].split()[0]) / 1024


def peak_rss_mib() -> float:
    return rss_mib("VmHWM")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def ortflow_child(artifacts: Path, train: Path, mem_reuse: bool, order: str, batch: int, steps: int) -> dict:
    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from ortflow.data.shards import ShardReader
    from ortflow.sessions import session_options

    options = session_options(1)
    options.enable_mem_pattern = False
    options.enable_mem_reuse = mem_reuse
    options.execution_order = getattr(ort.ExecutionOrder, order)
    state = CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    module = Module(str(artifacts / "training_model.onnx"), state, None, session_options=options)
    optimizer = Optimizer(str(artifacts / "optimizer_model.onnx"), module)
    reader = ShardReader(train)
    module.train()
    before = rss_mib()
    times, losses = [], []
    for step in range(steps):
        data = reader.gather(np.arange(step * batch, (step + 1) * batch))
        ort.set_seed(step)  # the same Dropout masks in every run: the losses can be compared
        started = time.perf_counter()
        module.lazy_reset_grad()
        losses.append(float(module(*[data[name] for name in module.input_names()])[0]))
        optimizer.step()
        times.append(time.perf_counter() - started)
    return {"peak_rss_mib": peak_rss_mib(), "rss_before_steps_mib": before, "step_s": min(times[WARMUP:]), "losses": losses[:3]}


def torch_child(train: Path, checkpointing: bool, args) -> dict:
    import torch

    from ortflow.data.shards import ShardReader
    import transformers_models

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = getattr(transformers_models, WRAPPERS[args.model])(**model_kwargs(args))
    if checkpointing:
        model.model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # ONNX Runtime's Module and Optimizer hold the gradients and moments before the first step;
    # torch makes them in it. Made here too, so that what the steps add is comparable.
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    reader = ShardReader(train)
    before = rss_mib()
    times = []
    for step in range(args.steps):
        data = reader.gather(np.arange(step * args.batch, (step + 1) * args.batch))
        started = time.perf_counter()
        inputs = [torch.from_numpy(data[name]) for name in FEATURES[args.model]]
        loss = torch.nn.functional.cross_entropy(model(*inputs), torch.from_numpy(data["y"]))
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return {"peak_rss_mib": peak_rss_mib(), "rss_before_steps_mib": before, "step_s": min(times[WARMUP:])}


def child(spec: dict) -> dict:
    """Run one measurement in a fresh process and return what it printed."""
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                            env={"PYTHONPATH": f"{REPO / 'src'}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"})
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(WRAPPERS), default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256, help="256: bytes; 50257: GPT-2's own, 30522: BERT's")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        reset_peak()
        sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]
        args = argparse.Namespace(**spec["args"])
        if spec["kind"] == "ortflow":
            out = ortflow_child(Path(spec["artifacts"]), Path(spec["train"]), spec["mem_reuse"], spec["order"],
                                args.batch, args.steps)
        else:
            out = torch_child(Path(spec["train"]), spec["checkpointing"], args)
        print(json.dumps(out))
        return
    with tempfile.TemporaryDirectory() as folder:
        train, root = build(Path(folder), args)
        common = {"args": vars(args) | {"child": None}, "train": str(train)}
        rows = [(label, child(common | {"kind": "ortflow", "artifacts": str(root / recompute), "mem_reuse": reuse,
                                        "order": order}))
                for label, recompute, reuse, order in ORTFLOW]
        rows += [(label, child(common | {"kind": "torch", "checkpointing": checkpointing}))
                 for label, checkpointing in TORCH]
    print(f"{args.model} {args.layers} layers, width {args.width}, context {args.context}, vocabulary {args.vocab}, "
          f"batch {args.batch}, 1 thread")
    peer = dict(rows)[TORCH[1][0]]
    print("| run | peak RSS (MiB) | before the steps (MiB) | the steps add (MiB) | step (s) | peak / HF's | step / HF's |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, row in rows:
        print(f"| {label} | {row['peak_rss_mib']:.0f} | {row['rss_before_steps_mib']:.0f} | "
              f"{row['peak_rss_mib'] - row['rss_before_steps_mib']:.0f} | {row['step_s']:.2f} | "
              f"{row['peak_rss_mib'] / peer['peak_rss_mib']:.2f} | {row['step_s'] / peer['step_s']:.2f} |")
    print("first losses:", {label: row["losses"] for label, row in rows if "losses" in row})


if __name__ == "__main__":
    main()
