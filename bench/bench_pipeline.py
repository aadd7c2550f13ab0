"""Pipeline stages (`train.pipeline_stages: P`): per rank, its peak memory against the
share of the model's parameters its stage holds; the share of a step the rank waited on
its neighbours (the bubble) against the schedule's theoretical (P - 1) / (m + P - 1);
and the step time against P = 1 at the same global batch.

Runs the real workflow (`snakemake train`, bench_stages.run_stage) on the built-in `gpt`
over Python's documentation, once per P, in the same run on the same data. The global
batch is always micro_batch x M (--micro-batches): P = 1 is world_size copies each
accumulating M / world_size micro-batches, P stages are world_size / P copies each
pipelining m = M / copies micro-batches. Each rank's peak RSS and wait share come from
the train stage's metrics.json, the stages' parameters from artifacts/pipeline.json
(a weight two stages read, counted in both).

    python bench/bench_pipeline.py                                  # GPT-2's shape, 86M with bytes
    python bench/bench_pipeline.py --stages 1 2 4 --world-size 4    # 4 ranks (on 2 cores: memory only)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from bench_stages import config, run_stage


def run(args, stages: int) -> dict:
    """The workflow up to `train` at `stages` stages: a row of what its ranks measured."""
    workdir = args.workdir / f"P{stages}"
    workdir.mkdir(parents=True, exist_ok=True)
    copies = args.world_size // stages
    micro_batches = args.micro_batches // copies  # m, each copy's
    settings = config(args)
    settings["train"] |= {"pipeline_stages": stages, "grad_accum_steps": micro_batches}
    configfile = workdir / "bench-config.yaml"
    configfile.write_text(yaml.safe_dump(settings))
    for stage in ("prepare_data", "build_artifacts", "train"):
        run_stage(workdir, configfile, stage, force=False)
    results = workdir / "results/stages"
    metrics = json.loads((results / "train/metrics.json").read_text())
    row = {"P": stages, "D": copies, "m": micro_batches, "step_s": metrics["step_time_p50_s"],
           "peak_rss_mb": [round(mb) for mb in metrics["peak_rss_mb"]],
           "waited": metrics.get("pipeline_waited_share"), "theory": (stages - 1) / (micro_batches + stages - 1)}
    if stages > 1:  # rank r holds stage r // copies
        plan = json.loads((results / "artifacts/pipeline.json").read_text())
        whole = json.loads((results / "artifacts/model.json").read_text())["parameters"]
        if plan["balance"] == "parameters":  # costs: each stage's parameters (a tied weight in each holder)
            row["held"] = [plan["costs"][rank // copies] / whole for rank in range(args.world_size)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ortflow-bench-pipeline"))
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8, help="M: the global batch's micro-batches")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--eval-fraction", type=float, default=0.002)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    rows = []
    for stages in args.stages:
        rows.append(run(args, stages))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["step_s"]
    print("| P x D | m | rank | stage's share of parameters | peak RSS (MB) | waited (share of step) "
          "| (P - 1) / (m + P - 1) | step (s) | step / first row's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        for rank, rss in enumerate(row["peak_rss_mb"]):
            share = f"{row['held'][rank]:.2f}" if "held" in row else "1 (whole)"
            waited = f"{row['waited'][rank]:.2f}" if row["waited"] else ""
            print(f"| {row['P']} x {row['D']} | {row['m']} | {rank} | {share} | {rss:,} | {waited} "
                  f"| {row['theory']:.2f} | {row['step_s']:.2f} | {row['step_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
