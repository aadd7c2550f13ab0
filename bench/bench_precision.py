"""train.precision: a training step of the default text model (config/text.yaml: the built-in
gpt, 2 layers, width 128, 4 heads, context 64, 16 sequences a rank) at fp32 against bf16
(graphs/precision.py: its multiplies in ortflow.BF16MatMul), one rank of one thread.

The artifacts are built by build_artifacts from the same config and seed at each precision (the
same initial weights); a step is the Module's forward and backward and ONNX Runtime's AdamW step,
on the same batches, with the session options and operator registration training uses
(engine.open_sessions' `training_options` and `precision.module_graphs`). Rounds alternate the
precisions; in a round each runs `--steps` steps, the first WARMUP left out, and the median of
the rest is kept; the table has the median over rounds and the median of the rounds' ratios, by
the wall clock and by the calling thread's CPU time, which a busy machine disturbs less.

    python bench/bench_precision.py [--rounds 5] [--steps 20] [--batch 16]
                                    [--width W --heads H --layers L --context T]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3
PRECISIONS = ("fp32", "bf16")


def build(workdir: Path, model: dict, context: int | None) -> tuple[dict[str, Path], Path]:
    """The text data prepared once and the artifacts at each precision, config/text.yaml's
    model with `model`'s keys (and data.context `context`) over it."""
    from ortflow import config as config_mod
    from ortflow.stages import build_artifacts, prepare_data

    data_keys = {"context": context} if context else {}
    configs = {name: config_mod.load(REPO / "config" / "text.yaml", overrides={
        "model": model, "data": data_keys, "train": {"precision": name}}) for name in PRECISIONS}
    data = workdir / "data"
    prepare_data.prepare(configs["fp32"], data / "train", data / "eval")
    for name, config in configs.items():
        build_artifacts.build(config, data / "train", workdir / name)
    return {name: workdir / name for name in PRECISIONS}, data / "train"


def step_times(artifacts: Path, train_dir: Path, steps: int, batch: int) -> dict[str, list[float]]:
    """Seconds of each of `steps` training steps at one thread, by the wall clock and by the CPU
    time of the calling thread (ONNX Runtime's pool of one and ATen's run on it)."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from ortflow.artifacts import Artifacts
    from ortflow.data.shards import ShardReader
    from ortflow.graphs import precision
    from ortflow.sessions import training_options

    files, options = Artifacts(artifacts), training_options(1)
    training_model, _ = precision.module_graphs(files, options, 1)
    state = CheckpointState.load_checkpoint(str(files.checkpoint))
    module = Module(training_model, state, None, session_options=options)
    optimizer = Optimizer(str(files.optimizer_model), module)
    reader, times = ShardReader(train_dir), {"wall": [], "cpu": []}
    module.train()
    for step in range(steps):
        feeds = reader.gather(np.arange(step * batch, (step + 1) * batch) % reader.manifest.records)
        start, start_cpu = time.perf_counter(), time.thread_time()
        module.lazy_reset_grad()
        module(*[feeds[name] for name in module.input_names()])
        optimizer.step()
        times["wall"].append(time.perf_counter() - start)
        times["cpu"].append(time.thread_time() - start_cpu)
    return times


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor()


def main() -> None:
    from ortflow.training.preflight import BF16_FLAGS, cpu_flags

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, help="model.width instead of config/text.yaml's")
    parser.add_argument("--heads", type=int, help="model.heads instead of config/text.yaml's")
    parser.add_argument("--layers", type=int, help="model.layers instead of config/text.yaml's")
    parser.add_argument("--context", type=int, help="data.context instead of config/text.yaml's")
    args = parser.parse_args()
    model = {key: getattr(args, key) for key in ("width", "heads", "layers") if getattr(args, key)}
    with tempfile.TemporaryDirectory() as workdir:
        artifacts, train_dir = build(Path(workdir), model, args.context)
        medians = {(name, clock): [] for name in PRECISIONS for clock in ("wall", "cpu")}
        for round_ in range(args.rounds):
            for name in PRECISIONS if round_ % 2 == 0 else PRECISIONS[::-1]:
                for clock, times in step_times(artifacts[name], train_dir, args.steps, args.batch).items():
                    medians[name, clock].append(statistics.median(times[WARMUP:]))
            print(f"round {round_ + 1}: " + ", ".join(f"{n} {c} {medians[n, c][-1] * 1e3:.1f} ms"
                                                      for n in PRECISIONS for c in ("wall", "cpu")))
    print(f"CPU: {cpu_name()}; bfloat16 units: {', '.join(sorted(cpu_flags() & BF16_FLAGS)) or 'none'}")
    print("| clock | fp32 step ms | bf16 step ms | fp32 / bf16 (median of rounds' ratios) |")
    print("| --- | ---: | ---: | ---: |")
    for clock in ("wall", "cpu"):
        ratios = [fp32 / bf16 for fp32, bf16 in zip(medians["fp32", clock], medians["bf16", clock])]
        print(f"| {clock} | {statistics.median(medians['fp32', clock]) * 1e3:.1f} | "
              f"{statistics.median(medians['bf16', clock]) * 1e3:.1f} | {statistics.median(ratios):.2f}x "
              f"(rounds {min(ratios):.2f} to {max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
