"""The largest models on this machine: a Llama-shaped transformers model (weights drawn from
run.seed, a byte vocabulary over Python's documentation padded to --vocab) through every stage
of the real workflow at 2 ranks, against Hugging Face's Trainer on the same model, data, batch
and context, in the same run.

ortflow: `snakemake <stage>` one stage after the other (bench_stages.run_stage: each stage's
wall time and the peak RSS of its largest process), with full fine-tuning by AdamW under
`train.zero: 1` and `train.recompute: blocks`, or (--lora) `model.lora` (its defaults: r 8 on
Llama's q_proj and v_proj) with `train.recompute: blocks`. From train's metrics.json: each
rank's peak RSS and the median step time.

The peer: transformers.Trainer with TrainingArguments(gradient_checkpointing=True,
use_cpu=True), AdamW, launched as --world-size processes by torchrun (gloo, one thread each,
as ortflow's ranks), on the same config (LlamaConfig, weights from the same seed but drawn by
torch) and the same train shards (input_ids the window, labels the window: transformers shifts
them), + peft's LoRA on the same targets with --lora. Each process reports its peak RSS
(VmHWM) and the median of its steps' times.

    python bench/bench_headline.py --workdir /tmp/hl-350m --hidden 1024 --layers 24 --intermediate 2816 --heads 16
    python bench/bench_headline.py --workdir /tmp/hl-1b --lora --hidden 2048 --layers 16 --intermediate 5632 \
        --heads 32 --stages prepare_data build_artifacts train merge_checkpoint export_model
    python bench/bench_headline.py --workdir /tmp/hl-1b --lora ... --peer-only    # the peer alone, again
    python bench/bench_headline.py --workdir /tmp/hl-350m ... --force --stages train   # train and the peer again

Step times are medians over all steps (few steps at these sizes, so the first is in them, for
both). The model's files go to --workdir (several GB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench_stages import BIN, REPO, STAGES, run_stage


def llama_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.context,
        attention_dropout=0.0, tie_word_embeddings=False)


def ortflow_config(args, model_folder: Path) -> dict:
    train = {"world_size": args.world_size, "micro_batch_size": args.micro_batch, "steps": args.steps,
             "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.0}, "lr_schedule": {"name": "constant"},
             "log_every": 1, "eval_every": args.steps, "checkpoint_every": args.steps,
             "eval_batch_size": args.micro_batch, "recompute": "blocks"}
    model = {"kind": "transformers", "path": str(model_folder), "task": "causal-lm"}
    if args.lora:
        model["lora"] = {}
    else:
        train["zero"] = 1
    return {"run": {"name": "headline", "seed": 1},
            "data": {"source": "text", "context": args.context, "eval_fraction": args.eval_fraction, "shards": 2},
            "model": model, "train": train,
            "export": {"quantize": "dynamic", "max_accuracy_drop": 100.0}}


def rss_mib(field: str) -> float:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status[field].split()[0]) / 1024


def peer_rank(spec: dict) -> None:
    """One process of the peer under torchrun: Trainer's steps, then this rank's figures on stdout."""
    import numpy as np
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "src"))
    from ortflow.data.shards import ShardReader

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: not torchrun's or the imports' parent
    args = argparse.Namespace(**spec["args"])
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(llama_config(args))
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
    reader = ShardReader(spec["train"])

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(reader)

        def __getitem__(self, index):
            x = torch.from_numpy(reader.gather(np.array([index]))["x"][0].astype(np.int64))
            return {"input_ids": x, "labels": x}

    times: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.started)

    arguments = transformers.TrainingArguments(
        output_dir=spec["output"], per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
        learning_rate=1e-4, weight_decay=0.0, lr_scheduler_type="constant", optim="adamw_torch",
        gradient_checkpointing=True, use_cpu=True, ddp_backend="gloo", save_strategy="no", report_to=[],
        logging_steps=1, dataloader_num_workers=0, seed=1)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Windows(),
                                   callbacks=[StepTimes()])
    trainer.train()
    print("PEER " + json.dumps({"rank": int(os.environ["RANK"]), "peak_rss_mb": rss_mib("VmHWM"),
                                "step_time_p50_s": statistics.median(times), "steps": len(times)}), flush=True)


def metrics_step_times(metrics: dict) -> list[float]:
    """Each step's time, from the throughput logged at every step (train.log_every 1)."""
    return [metrics["global_batch_size"] / entry["samples_per_s"] for entry in metrics["history"]["train"]]



def run_peer(args, workdir: Path) -> dict:
    """Trainer in --world-size processes (torchrun): each rank's peak and the slowest rank's median step."""
    spec = {"args": vars(args), "train": str(workdir / "results/headline/data/train"),
            "output": str(workdir / "peer")}
    command = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={args.world_size}", __file__,
               "--peer-rank", json.dumps(spec, default=str)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}:{REPO / 'bench'}"}
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode:
        raise SystemExit(f"the peer failed:\n{result.stderr[-4000:]}")
    # The ranks print at once: their lines can run together ("PEER {...}PEER {...}").
    ranks = sorted((json.loads(found) for found in re.findall(r"PEER (\{[^{}]*\})", result.stdout)),
                   key=lambda rank: rank["rank"])
    return {"peak_rss_mb": [round(rank["peak_rss_mb"]) for rank in ranks],
            "step_time_p50_s": round(max(rank["step_time_p50_s"] for rank in ranks), 2),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ortflow-bench-headline"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no grouped-query attention)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--eval-fraction", type=float, default=0.002)
    parser.add_argument("--lora", action="store_true", help="model.lora (its defaults) against Trainer + peft")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=STAGES)
    parser.add_argument("--force", action="store_true",
                        help="run --stages again though up to date (train's step time again, back to back with the peer)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--peer-only", action="store_true", help="the peer alone, on a workdir that has the data")
    parser.add_argument("--peer-rank", help=argparse.SUPPRESS)  # set by run_peer for torchrun's processes
    args = parser.parse_args()
    if args.peer_rank:
        return peer_rank(json.loads(args.peer_rank))

    model_folder = args.workdir / "llama"
    model_folder.mkdir(parents=True, exist_ok=True)
    llama_config(args).save_pretrained(model_folder)  # config.json alone: weights drawn from run.seed
    configfile = args.workdir / "bench-config.yaml"
    configfile.write_text(yaml.safe_dump(ortflow_config(args, model_folder)))
    print(f"load: {os.getloadavg()}", flush=True)
    rows, train = [], None
    for stage in [] if args.peer_only else args.stages:
        rows.append(run_stage(args.workdir, configfile, stage, args.force))
        if stage == "build_artifacts":
            info = json.loads((args.workdir / "results/headline/artifacts/model.json").read_text())
            print(f"model: {info['parameters']:,} parameters, {info['parameters'] * 4 / 1e9:.2f} GB float32",
                  flush=True)
        if stage == "train":
            metrics = json.loads((args.workdir / "results/headline/train/metrics.json").read_text())
            train = {"peak_rss_mb": [round(mb) for mb in metrics["peak_rss_mb"]],
                     "step_time_p50_s": round(statistics.median(metrics_step_times(metrics)), 2)}
            print("ortflow train: " + json.dumps(train), flush=True)
        print(json.dumps(rows[-1]), flush=True)
    peer = None if args.no_peer else run_peer(args, args.workdir)
    if peer:
        print("peer: " + json.dumps(peer), flush=True)
    print(f"load: {os.getloadavg()}", flush=True)
    print("| stage | wall time (s) | peak RSS (GB) |\n| --- | ---: | ---: |")
    for row in rows:
        print(f"| `{row['stage']}` | {row['seconds']} | {row['peak_rss_gb']} |")
    print("| training | peak RSS a rank (GiB) | step (s) |\n| --- | ---: | ---: |")
    for label, run in (("ortflow", train), ("HF Trainer", peer)):
        if run:
            print(f"| {label} | {', '.join(f'{mb / 1024:.2f}' for mb in run['peak_rss_mb'])} | "
                  f"{run['step_time_p50_s']} |")

if __name__ == "__main__":
    main()
