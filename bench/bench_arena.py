"""A training rank's memory with one CPU arena for its sessions (sessions.share_cpu_arena)
against an arena a session (ONNX Runtime's default) and against no arena: GPT-2 124M
(bench_train.py's config, `train.precision` fp32 or bf16), its sessions opened as a rank opens
them (engine.open_sessions), one rank of one thread, each variant in a fresh process.

In each: `--steps` training steps (forward and backward) of 4 sequences, then two evaluations
of `--eval-batch` sequences (bench_train's runs evaluate 8 at a time), then one more step. For
each phase the peak RSS (VmHWM, reset by clear_refs 5 before it) and, for the steps, the median
time after the first two. Rounds alternate the variants' order.

    python bench/bench_arena.py [--precision bf16] [--steps 8] [--eval-batch 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import bench_train
from bench_precision import cpu_name

VARIANTS = ("an arena a session", "one arena", "no arena")
WARMUP = 2


def peak_mib() -> float:
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


def phase(run) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of `run()`."""
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    run()
    return peak_mib(), time.perf_counter() - start


def child(variant: str, results: Path, steps: int, eval_batch: int) -> None:
    """One variant's phases, printed as a JSON line."""
    from ortflow import config
    from ortflow.artifacts import Artifacts
    from ortflow.data.shards import ShardReader
    from ortflow.training import engine

    if variant != "one arena":
        engine.share_cpu_arena = lambda options: None
    if variant == "no arena":
        with_arena = engine.training_options

        def without_arena(*args, **kwargs):
            options = with_arena(*args, **kwargs)
            options.enable_cpu_mem_arena = False
            return options

        engine.training_options = without_arena
    files = Artifacts(results / "artifacts")
    module, _ = engine.open_sessions(files, engine.initial_state(files), "cpu", 1, config.load().train.optimizer, np)
    reader = ShardReader(results / "data/train")

    def run(first: int, batch: int) -> None:
        feeds = reader.gather(np.arange(first, first + batch) % reader.manifest.records)
        module(*[feeds[name] for name in module.input_names()])

    module.train()
    train = [phase(lambda: run(4 * step, 4)) for step in range(steps)]
    module.eval()
    evals = [phase(lambda: run(eval_batch * i, eval_batch)) for i in range(2)]
    module.train()
    after = phase(lambda: run(0, 4))
    print(json.dumps({"step peak": max(p for p, _ in train), "eval peak": max(p for p, _ in evals),
                      "step after eval peak": after[0], "step s": statistics.median(s for _, s in train[WARMUP:])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # variant, results folder
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.steps, args.eval_batch)
        return
    os.environ["PATH"] = f"{bench_train.BIN}{os.pathsep}{os.environ['PATH']}"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bench_train.REPO / "tests"),
                                                             os.environ.get("PYTHONPATH")]))
    measured = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ortflow-bench-") as tmp:
        workdir = Path(tmp)
        bench_train.inputs(workdir)
        name = f"gpt2-124m-{args.precision}"
        bench_train.prepare(workdir, name, config=bench_train.STAGES["gpt2-124m"],
                            train={"precision": args.precision})
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % len(VARIANTS):] + VARIANTS[:round_ % len(VARIANTS)]
            for variant in order:
                done = subprocess.run(
                    [sys.executable, __file__, "--child", variant, str(workdir / "results" / name),
                     "--steps", str(args.steps), "--eval-batch", str(args.eval_batch)],
                    env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, check=True)
                measured[variant].append(json.loads(done.stdout.splitlines()[-1]))
                print(f"round {round_ + 1}: {variant}: {measured[variant][-1]}", flush=True)
    print(f"CPU: {cpu_name()}")
    keys = ("step peak", "eval peak", "step after eval peak")
    print(f"| {args.precision}, 1 rank | " + " | ".join(f"{key} MiB" for key in keys) + " | step s |")
    print("| --- | " + " | ".join("---:" for _ in keys) + " | ---: |")
    for variant, runs in measured.items():
        print(f"| {variant} | " + " | ".join(f"{max(r[key] for r in runs):,.0f}" for key in keys)
              + f" | {statistics.median(r['step s'] for r in runs):.2f} |")


if __name__ == "__main__":
    main()
