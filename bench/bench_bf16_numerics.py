"""Issue 44's numerics at realistic size: `train.precision: bf16` against torch's autocast bf16
from the same initial weights and batches, on GPT-2 124M and BERT-base (bench_train.py's
configs and data).

For each model the workflow builds bf16 artifacts (dropout off, so that both sides compute the
same function; no weight decay). Then, one after another in this process (the machine's cores
for each), `--steps` AdamW steps at a fixed learning rate on the same consecutive batches of
`--batch` records:

- `ortflow bf16`: the rewritten training graph in a Module opened as a rank opens it
  (graphs/precision.module_graphs), ONNX Runtime's AdamW from the artifacts;
- `autocast`: the same torch module (tests/transformers_models.py) with the artifacts' initial
  weights, torch.optim.AdamW, the forward under torch.autocast("cpu", dtype=torch.bfloat16), the
  batch as one micro-batch;
- `autocast, halves`: the same with the batch as two accumulated halves, so that the weights'
  gradients are summed in another order: the spread between two autocast runs that differ only
  in reduction order, which ortflow's curve is asked to stay within.

Printed: the losses every 10 steps, the largest gap over the steps between ortflow and
autocast against the largest gap between the two autocast runs, and the mean of the last 5.

    python bench/bench_bf16_numerics.py [--models gpt2-124m bert-base] [--steps 50] [--batch 4] [--lr 1e-4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))  # transformers_models, which the configs name

from bench_train import BIN, STAGES, inputs, prepare  # noqa: E402

# Dropout off on both sides (each draws its own masks); the kwargs go to the models' configs.
NO_DROPOUT = {"gpt2-124m": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
              "bert-base": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}


def batches(data: Path, steps: int, batch: int):
    from ortflow.data.shards import ShardReader

    reader = ShardReader(data)
    for step in range(steps):
        yield reader, reader.gather(np.arange(step * batch, (step + 1) * batch) % reader.manifest.records)


def ortflow_losses(artifacts: Path, data: Path, steps: int, batch: int, lr: float) -> list[float]:
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from ortflow.artifacts import Artifacts
    from ortflow.graphs import precision
    from ortflow.sessions import training_options

    cores = len(os.sched_getaffinity(0))
    files, options = Artifacts(artifacts), training_options(cores)
    training_model, eval_model = precision.module_graphs(files, options, cores)
    module = Module(training_model, CheckpointState.load_checkpoint(str(files.checkpoint)), eval_model,
                    session_options=options)
    optimizer = Optimizer(str(files.optimizer_model), module)
    optimizer.set_learning_rate(lr)
    module.train()
    losses = []
    for _, records in batches(data, steps, batch):
        module.lazy_reset_grad()
        losses.append(float(module(*[records[name] for name in module.input_names()])[0]))
        optimizer.step()
    return losses


def torch_losses(config: dict, artifacts: Path, data: Path, steps: int, batch: int, lr: float,
                 parts: int) -> list[float]:
    """autocast bf16 on the same module, weights and batches; the batch as `parts` accumulated micro-batches."""
    import importlib

    import torch

    from ortflow.artifacts import Artifacts
    from ortflow.checkpoints.reader import load_parameters_file

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    module_name, class_name = config["model"]["path"].split(":")
    model = getattr(importlib.import_module(module_name), class_name)(**config["model"]["kwargs"])
    weights = load_parameters_file(Artifacts(artifacts).checkpoint)
    loaded = model.load_state_dict({name: torch.from_numpy(array.copy()) for name, array in weights.items()},
                                   strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"model.lm_head.weight"}, loaded  # tied head
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for reader, records in batches(data, steps, batch):
        features = [torch.from_numpy(records[feature.name]) for feature in reader.manifest.features]
        labels = torch.from_numpy(records[reader.label_name])
        optimizer.zero_grad()
        total = 0.0
        for part in range(parts):
            rows = slice(part * batch // parts, (part + 1) * batch // parts)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(*[feature[rows] for feature in features])
            loss = torch.nn.functional.cross_entropy(logits.float(), labels[rows]) / parts
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses


def compare(name: str, workdir: Path, steps: int, batch: int, lr: float) -> None:
    config = STAGES[name]
    config = {**config, "model": {**config["model"], "kwargs": {**config["model"]["kwargs"], **NO_DROPOUT[name]}}}
    prepared = prepare(workdir, f"{name}-numerics", config=config,
                       train={"precision": "bf16", "optimizer": {"weight_decay": 0.0}})
    artifacts, data = workdir / f"results/{name}-numerics/artifacts", workdir / f"results/{name}-numerics/data/train"
    curves = {"ortflow bf16": ortflow_losses(artifacts, data, steps, batch, lr)}
    print(f"{name}: ortflow bf16 done", flush=True)
    for label, parts in (("autocast", 1), ("autocast, halves", 2)):
        curves[label] = torch_losses(prepared, artifacts, data, steps, batch, lr, parts)
        print(f"{name}: {label} done", flush=True)
    print(f"{name}, {steps} AdamW steps at lr {lr}, batch {batch} ({len(os.sched_getaffinity(0))} threads): "
          "step | " + " | ".join(curves))
    for step in [0, *range(9, steps, 10)]:
        print(f"{name}: {step + 1} | " + " | ".join(f"{losses[step]:.5f}" for losses in curves.values()))
    gap = lambda a, b: max(abs(x - y) for x, y in zip(curves[a], curves[b]))  # noqa: E731
    print(f"{name}: largest gap over the steps: ortflow bf16 - autocast {gap('ortflow bf16', 'autocast'):.5f}, "
          f"autocast - autocast halves {gap('autocast', 'autocast, halves'):.5f}")
    print(f"{name}: mean of the last 5: " + ", ".join(f"{label} {np.mean(losses[-5:]):.5f}"
                                                    for label, losses in curves.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(NO_DROPOUT), default=list(NO_DROPOUT))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    # The transformers wrapper, for build_artifacts (PYTHONPATH).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="ortflow-bench-") as tmp:
        workdir = Path(tmp)
        inputs(workdir)
        for name in args.models:
            compare(name, workdir, args.steps, args.batch, args.lr)


if __name__ == "__main__":
    main()
