"""Wall time and peak memory of each stage at a realistic model size.

Runs the real workflow (`snakemake <stage>`, one stage after the other, each
target only its own job since the ones before it are up to date) on the built-in
`gpt` over Python's documentation (byte vocabulary), and reports per stage the
wall time and the peak resident memory of the largest process of that stage
(`ru_maxrss` of the Snakemake process tree, from wait4: for `train` that is one
rank), with the model's size in parameters and bytes.

    python bench/bench_stages.py --width 768 --layers 12 --heads 12                  # about GPT-2's 124M (86M with bytes)
    python bench/bench_stages.py --width 2048 --layers 11 --heads 16 --optimizer sgd \
        --stages prepare_data build_artifacts train merge_checkpoint export_model     # over 2 GB of weights
    PYTHONPATH=<other ortflow>/src python bench/bench_stages.py --force \
        --stages merge_checkpoint export_model quantize_model build_artifacts         # the same stages, other code

Run it under the machine-wide lock on a shared machine; the model's files go to
--workdir (several GB for the larger model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ["prepare_data", "build_artifacts", "train", "merge_checkpoint", "export_model", "quantize_model"]


def config(args) -> dict:
    return {
        "run": {"name": "stages", "seed": 1},
        "data": {"source": "text", "context": args.context, "eval_fraction": args.eval_fraction, "shards": 2},
        "model": {"kind": "gpt", "layers": args.layers, "heads": args.heads, "width": args.width,
                  "loss": "cross_entropy"},
        "train": {"world_size": args.world_size, "micro_batch_size": args.micro_batch, "steps": args.steps,
                  "optimizer": {"name": args.optimizer, "lr": 1e-4, "weight_decay": 0.0},
                  "lr_schedule": {"name": "constant"}, "log_every": 1, "eval_every": args.steps,
                  "checkpoint_every": args.steps, "eval_batch_size": args.micro_batch},
        "export": {"quantize": "dynamic", "max_accuracy_drop": 100.0},
    }


def run_stage(workdir: Path, configfile: Path, stage: str, force: bool) -> dict:
    """One Snakemake target (`force`: run again though up to date): its wall time and the
    peak RSS of its largest process."""
    command = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(configfile), "--cores", "2", stage]
    if force:  # not mtime: stages forced earlier must not make the ones after them outdated
        command += ["-f", "--rerun-triggers", "params", "input", "software-env", "code"]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{stage} failed:\n{process.stderr.read()[-4000:]}")
    return {"stage": stage, "seconds": round(seconds, 1), "peak_rss_gb": round(usage.ru_maxrss / 1024**2, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ortflow-bench-stages"))
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--eval-fraction", type=float, default=0.002)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=STAGES)
    parser.add_argument("--force", action="store_true",
                        help="run the stages again in a workdir that has them (another version of ortflow on "
                             "PYTHONPATH, the same inputs)")
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    configfile = args.workdir / "bench-config.yaml"
    configfile.write_text(yaml.safe_dump(config(args)))
    rows = []
    for stage in args.stages:
        rows.append(run_stage(args.workdir, configfile, stage, args.force))
        if stage == "build_artifacts":
            info = json.loads((args.workdir / "results/stages/artifacts/model.json").read_text())
            print(f"model: {info['parameters']:,} parameters, {info['parameters'] * 4 / 1e9:.2f} GB float32",
                  flush=True)
        print(json.dumps(rows[-1]), flush=True)
    print("| stage | wall time (s) | peak RSS (GB) |\n| --- | ---: | ---: |")
    for row in rows:
        print(f"| `{row['stage']}` | {row['seconds']} | {row['peak_rss_gb']} |")


if __name__ == "__main__":
    main()
