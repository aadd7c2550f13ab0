"""Training throughput: ortflow against PyTorch DistributedDataParallel (gloo),
and ortflow's scaling from 1 to 2 ranks, on the same machine in the same run.

For each model (the MLP 784-1024-1024-10 at 256 samples per rank, the
`gpt` model on Python's docs, and transformers' GPT2LMHeadModel on the same
text through the wrapper of tests/transformers_models.py), it builds the data
and artifacts with the real workflow, then alternates rounds of: ortflow with 2 ranks, DDP with 2 ranks
(threads shared out as ortflow does, and with torch's defaults), ortflow with
1 rank on one core (for scaling: each rank brings one core) and on all cores. Each run reports steady-state samples/s (the first steps
left out); the best of the rounds is kept, which is the least disturbed by
whatever else the machine does. Achieved FLOP/s is given as a fraction of the
machine's float32 matrix-multiply peak, measured with numpy on all cores.

    python bench/bench_train.py [--rounds 3] [--steps 60] [--models mlp gpt gpt2-transformers]

With --stages (GPT-2 124M, BERT-base 110M), each model instead goes once through
every stage of the workflow at 2 ranks (prepare_data to quantize_model), with
each stage's wall time and peak memory, and is compared with DDP on the same
model, batch and steps:

    python bench/bench_train.py --stages gpt2-124m bert-base --steps 10

With --zero, ZeRO-1's memory at 2 ranks: ortflow with train.zero 0 and 1, and
DDP with torch.optim.AdamW and with torch's ZeroRedundancyOptimizer around it,
each rank's peak RSS and optimizer state, and the step time:

    python bench/bench_train.py --zero gpt2-124m --steps 5 --warmup 2

With --by-task, a save_pretrained folder of GPT-2 and of a BERT encoder (both at
6 layers, width 384) trains at 2 ranks two ways from the same folder, in
alternating rounds: by task (`model.kind: transformers`, with the attention
that hugging_face.ATTENTION gives the family) and through the wrapper of
tests/transformers_models.py (`kind: torch`, transformers' default attention,
sdpa); samples/s, each rank's peak RSS and the graphs' node counts:

    python bench/bench_train.py --by-task gpt2 bert --rounds 2 --steps 30

With --bf16 (issue 44), `train.precision: bf16` at 2 ranks of one thread against DDP under
`torch.autocast("cpu", dtype=torch.bfloat16)` and DDP in float32, with ortflow at
train.zero 1 and at fp32 beside it, on GPT-2 124M and BERT-base; the runs alternated in
each round, the median step of steps warmup+1 to steps and each rank's peak RSS:

    python bench/bench_train.py --bf16 gpt2-124m bert-base --rounds 1 --steps 8 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WARMUP = 5

MODELS = {
    "mlp": {
        "data": {"source": "mnist_like.npz", "eval_fraction": 0.05},
        "model": {"kind": "mlp", "hidden": [1024, 1024]},
        "train": {"micro_batch_size": 256},
    },
    "gpt": {
        "data": {"source": "text", "context": 64, "eval_fraction": 0.05},
        "model": {"kind": "gpt", "layers": 2, "heads": 4, "width": 128},
        "train": {"micro_batch_size": 16},
    },
    "gpt2-transformers": {
        "data": {"source": "text", "context": 64, "eval_fraction": 0.05},
        "model": {"kind": "torch", "path": "transformers_models:GPT2", "kwargs": {"context": 64}},
        "train": {"micro_batch_size": 16},
    },
}
# Realistic sizes, through every stage once (--stages): GPT-2 at the GPT2Config
# defaults (124M: 12 layers, 12 heads, width 768, its 50,257-token vocabulary,
# looked up with byte ids) on 256 KiB of Python's docs, and BERT-base (110M) for
# classification on random token ids. The eval splits are small because the
# final evaluation, the export check and quantize_model read all of them.
STAGES = {
    "gpt2-124m": {
        "data": {"source": "text", "text_path": "docs.txt", "context": 128, "eval_fraction": 0.02},
        "model": {"kind": "torch", "path": "transformers_models:GPT2",
                  "kwargs": {"n_layer": 12, "n_head": 12, "n_embd": 768, "context": 128, "vocab_size": 50257}},
        "train": {"micro_batch_size": 4},
    },
    "bert-base": {
        "data": {"source": "tokens.npz", "features": ["input_ids", "attention_mask"], "eval_fraction": 0.05},
        "model": {"kind": "torch", "path": "transformers_models:BertClassifier",
                  "kwargs": {"vocab_size": 30522, "hidden_size": 768, "layers": 12, "heads": 12,
                             "intermediate_size": 3072, "max_position_embeddings": 512}},
        "train": {"micro_batch_size": 4},
    },
}
STAGE_RULES = ["prepare_data", "build_artifacts", "train", "merge_checkpoint", "export_model", "quantize_model"]
# The by-task path against the wrapper (--by-task), each from a folder that `by_task_folders` writes.
BY_TASK = {
    "gpt2": {
        "data": {"source": "text", "text_path": "docs.txt", "context": 128, "eval_fraction": 0.02},
        "by task": {"kind": "transformers", "path": "gpt2-folder", "task": "causal-lm"},
        "wrapper": {"kind": "torch", "path": "transformers_models:PretrainedGPT2", "kwargs": {"folder": "gpt2-folder"}},
        "train": {"micro_batch_size": 8},
    },
    "bert": {
        "data": {"source": "tokens.npz", "features": ["input_ids", "attention_mask"], "eval_fraction": 0.05},
        "by task": {"kind": "transformers", "path": "bert-folder"},
        "wrapper": {"kind": "torch", "path": "transformers_models:PretrainedBert",
                    "kwargs": {"folder": "bert-folder", "classes": 2}},
        "train": {"micro_batch_size": 8},
    },
}


def mnist_like(path: Path, n: int = 8192) -> None:
    """Random MNIST-shaped data: throughput does not depend on what the pixels are."""
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.random((n, 784), dtype=np.float32), y=rng.integers(0, 10, n))


def inputs(workdir: Path) -> None:
    """The raw data of every model: random MNIST-shaped records, 256 KiB of
    Python's docs, 640 random sequences of 128 BERT token ids (a random length
    of them unmasked) with random labels."""
    from pydoc_data.topics import topics

    mnist_like(workdir / "mnist_like.npz")
    (workdir / "docs.txt").write_text("\n\n".join(topics.values())[: 256 * 1024])
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30522, size=(640, 128))
    mask = (np.arange(128)[None, :] < rng.integers(32, 129, 640)[:, None]).astype(np.int64)
    np.savez(workdir / "tokens.npz", input_ids=ids * mask, attention_mask=mask, y=rng.integers(0, 2, 640))


def prepare(workdir: Path, name: str, target: str = "build_artifacts", train: dict | None = None,
            config: dict | None = None) -> dict:
    """Run the workflow up to `target` with the model's config (or `config`); its train settings
    turn off periodic work (`train` overrides them) so that steps time the step."""
    config = {"run": {"name": name}, **(config or {**MODELS, **STAGES}[name])}
    config["train"] = {**config["train"], "eval_every": 10**6, "checkpoint_every": 10**6,
                       "histogram_every": 10**6, "log_every": 10**6, "clip_grad_norm": None, **(train or {})}
    (workdir / "bench.yaml").write_text(yaml.safe_dump(config))
    subprocess.run([str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(workdir),
                    "--configfile", str(workdir / "bench.yaml"), "--cores", "2", target,
                    "--quiet", "all"], check=True)
    from ortflow import config as config_mod

    return config_mod.as_dict(config_mod.load(workdir / "bench.yaml"))


def run_ortflow(workdir: Path, config: dict, world_size: int, steps: int, one_core: bool = False) -> float:
    """Steady-state samples/s and FLOP/s of `ortflow train`; `one_core` pins the
    run to one core (the resources of one rank of a 2-rank run)."""
    metrics = ortflow_metrics(workdir, config, world_size, steps, one_core)
    return metrics["samples_per_s"], metrics["flops_per_s"]


def ortflow_metrics(workdir: Path, config: dict, world_size: int, steps: int, one_core: bool = False) -> dict:
    """metrics.json of `ortflow train` on the artifacts `prepare` built (see run_ortflow)."""
    from ortflow.training.run_folder import TrainFolder

    name = config["run"]["name"]
    config = json.loads(json.dumps(config))
    config["train"].update(world_size=world_size, steps=steps)
    out = workdir / f"results/{name}/bench-train-w{world_size}"
    pin = ["taskset", "-c", "0"] if one_core else []
    subprocess.run([*pin, "ortflow", "train", "-n", str(world_size), "--config-json", json.dumps(config),
                    "--train", str(workdir / f"results/{name}/data/train"),
                    "--eval", str(workdir / f"results/{name}/data/eval"),
                    "--artifacts", str(workdir / f"results/{name}/artifacts"), "--out", str(out)],
                   check=True, cwd=workdir, stderr=subprocess.DEVNULL)
    metrics = json.loads(TrainFolder(out).metrics.read_text())
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return metrics


def decay_groups(module, opt: dict) -> list[dict]:
    """torch.optim.AdamW's two parameter groups as ortflow decays (train/weight_decay.py):
    none on what train.optimizer.no_decay picks out, embeddings being nn.Embedding tables."""
    import torch

    from ortflow.models.patterns import matches

    embeddings = {f"{name}.weight" for name, layer in module.named_modules() if isinstance(layer, torch.nn.Embedding)}
    groups = {True: [], False: []}
    for name, parameter in module.named_parameters():
        groups[matches(name, parameter.ndim, embeddings, opt["no_decay"])].append(parameter)
    return [{"params": groups[False], "weight_decay": opt["weight_decay"]}, {"params": groups[True], "weight_decay": 0.0}]


def ddp_optimizer(module, opt: dict, zero: bool):
    """torch.optim.AdamW over ortflow's decay groups; `zero`: inside torch's
    ZeroRedundancyOptimizer, which gives each rank the AdamW state of a part of the
    parameters (whole tensors, balanced by size) and broadcasts what it updated."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups, settings = decay_groups(module, opt), {"lr": opt["lr"], "betas": opt["betas"], "eps": opt["eps"]}
    if zero:
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **settings)
    return torch.optim.AdamW(groups, **settings)


def optimizer_state_bytes(optimizer) -> int:
    """The bytes of the optimizer state this rank holds (AdamW: its two moments and a step count a tensor)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own AdamW
    return sum(value.nbytes for state in local.state.values() for value in state.values() if hasattr(value, "nbytes"))


def ddp_worker(rank: int, world_size: int, workdir: str, config: dict, port: int, queue, run: dict) -> None:
    """One rank of the PyTorch DDP baseline: same model, data, batch and optimizer.
    `run`: steps; warmup, the first steps left out of the timing; share_cores: each
    rank gets cores // ranks threads, as ortflow's ranks do, otherwise torch's
    default (every rank a thread per core); zero: ZeroRedundancyOptimizer; autocast: the
    forward under torch.autocast("cpu", dtype=torch.bfloat16)."""
    import torch
    import torch.distributed as dist

    from ortflow import config as config_mod
    from ortflow.data.shards import ShardReader
    from ortflow.models import built_in, user
    from ortflow.graphs.loss import resolve_loss

    if run["share_cores"]:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    name = config["run"]["name"]
    reader = ShardReader(Path(workdir) / f"results/{name}/data/train", verify=False)
    manifest = reader.manifest
    torch.manual_seed(0)
    spec = config_mod.typed(config).model
    module = (user.import_torch(spec.path, spec.kwargs) if spec.kind == "torch"
              else built_in(spec, manifest, resolve_loss(spec.loss, manifest)))
    model = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = ddp_optimizer(module, config["train"]["optimizer"], run["zero"])
    micro = config["train"]["micro_batch_size"]
    features, label = reader.feature_names, reader.label_name
    times = []
    for step in range(run["steps"]):
        started = time.perf_counter()
        (batch,) = reader.micro_batches(step, 0, rank, world_size, micro, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run["autocast"]):
            logits = model(*[torch.from_numpy(batch[feature]) for feature in features])
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(batch[label]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    steady = times[run["warmup"]:]
    queue.put({"rank": rank, "samples_per_s": micro * world_size / float(np.mean(steady)),
               "step_s": float(np.median(steady)), "optimizer_state_bytes": optimizer_state_bytes(optimizer),
               "parameter_bytes": sum(parameter.nbytes for parameter in module.parameters()),
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})  # ru_maxrss: KiB on Linux


def run_ddp(workdir: Path, config: dict, world_size: int, steps: int, share_cores: bool = True, zero: bool = False,
            warmup: int = WARMUP, autocast: bool = False) -> list[dict]:
    """Each rank's report, by rank: samples/s and median step time after `warmup`
    steps, optimizer state bytes and peak RSS in MB (see ddp_worker)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    run = {"steps": steps, "warmup": warmup, "share_cores": share_cores, "zero": zero, "autocast": autocast}
    mp.start_processes(ddp_worker, args=(world_size, str(workdir), config, port, queue, run),
                       nprocs=world_size, start_method="spawn")
    return sorted((queue.get() for _ in range(world_size)), key=lambda report: report["rank"])


def matmul_peak(seconds: float = 3.0, n: int = 1024) -> float:
    """float32 matrix-multiply FLOP/s of numpy's BLAS on all cores (best of repeats)."""
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = a.copy()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - started))
    return best


def stages(workdir: Path, name: str, steps: int, peak: float) -> None:
    """Every stage of `name` once at 2 ranks, from Snakemake's benchmark files
    (wall time, peak RSS; train's covers mpirun and both ranks), each rank's peak
    RSS from metrics.json, then DDP on the same model, batch and steps."""
    from ortflow.training.run_folder import TrainFolder

    # One small evaluation at the end of training; no checkpoint but the final one.
    config = prepare(workdir, name, "quantize_model", {"steps": steps, "eval_batches": 1, "eval_batch_size": 8,
                                                        "world_size": 2})
    results = workdir / f"results/{name}"
    print(f"{name}: stage | wall s | peak RSS MB (Snakemake's benchmark file)")
    for rule in STAGE_RULES:
        row = (results / f"benchmarks/{rule}.tsv").read_text().splitlines()
        values = dict(zip(row[0].split("\t"), row[1].split("\t")))
        print(f"{name}: {rule} | {float(values['s']):.1f} | {float(values['max_rss']):,.0f}")
    model = json.loads((results / "artifacts/model.json").read_text())
    metrics = json.loads(TrainFolder(results / "train").metrics.read_text())
    ddp_reports = run_ddp(workdir, config, 2, steps)
    ddp, ddp_peak = ddp_reports[0]["samples_per_s"], [report["peak_rss_mb"] for report in ddp_reports]
    per_sample = sum(model["flops_per_sample"].values())
    print(f"{name}: {model['parameters']:,} parameters, {per_sample / 1e9:.2f} GFLOP per sample (forward + backward)")
    for label, samples_per_s, rss in (("ortflow W=2", metrics["samples_per_s"], metrics["peak_rss_mb"]),
                                      ("DDP W=2", ddp, ddp_peak)):
        print(f"{name}: {label} {samples_per_s:.2f} samples/s, {samples_per_s * per_sample / peak:.2f} of the matmul "
              f"peak, peak RSS per rank {', '.join(f'{mb:,.0f}' for mb in rss)} MB")
    print(f"{name}: ortflow/DDP {metrics['samples_per_s'] / ddp:.2f}x")


def ortflow_state_bytes(artifacts: Path, world_size: int, zero: int) -> tuple[int, list[int]]:
    """The parameters' bytes, and the bytes of AdamW's two moments each rank holds:
    all of them, or under train.zero 1 those of its own slices, which the trainer
    lays out from the parameters (sharding.layout_of; here the artifacts' initial ones)."""
    from ortflow.artifacts import Artifacts
    from ortflow.checkpoints.ort_format import read_ort_checkpoint
    from ortflow.training.sharding import layout_of

    state = read_ort_checkpoint(Artifacts(artifacts).checkpoint)
    trained = [name for name, flag in state.requires_grad.items() if flag]
    moments = 2 * sum(state.parameters[name].nbytes for name in trained)
    if not zero:
        return sum(array.nbytes for array in state.parameters.values()), [moments] * world_size
    owned = [sum(2 * state.parameters[name].itemsize * (stop - start) for name, (start, stop) in part.items()
                 if name in trained) for part in layout_of(state.parameters, trained, 2, world_size)]
    return sum(array.nbytes for array in state.parameters.values()), owned


def median_step(metrics: dict, warmup: int) -> float:
    """The median step time in s of metrics.json's history (train.log_every 1) after `warmup` steps."""
    return float(np.median([metrics["global_batch_size"] / entry["samples_per_s"]
                            for entry in metrics["history"]["train"] if entry["step"] > warmup]))


def bf16(workdir: Path, name: str, rounds: int, steps: int, warmup: int) -> None:
    """train.precision: bf16 against DDP + autocast bf16 and DDP fp32 (see the module's
    docstring); ortflow's artifacts are built at each precision under their own run name."""
    configs = {precision: prepare(workdir, f"{name}-{precision}", config=STAGES[name],
                                  train={"precision": precision, "log_every": 1, "eval_batches": 1, "eval_batch_size": 8})
               for precision in ("fp32", "bf16")}
    bf16_config = configs["bf16"]
    runs = {
        "ortflow bf16, train.zero 0": lambda: ortflow_metrics(workdir, bf16_config, 2, steps),
        "DDP + autocast bf16": lambda: run_ddp(workdir, bf16_config, 2, steps, warmup=warmup, autocast=True),
        "ortflow bf16, train.zero 1": lambda: ortflow_metrics(
            workdir, {**bf16_config, "train": {**bf16_config["train"], "zero": 1}}, 2, steps),
        "DDP fp32": lambda: run_ddp(workdir, bf16_config, 2, steps, warmup=warmup),
        "ortflow fp32, train.zero 0": lambda: ortflow_metrics(workdir, configs["fp32"], 2, steps),
    }
    measured = {label: [] for label in runs}
    for round_ in range(rounds):
        # Alternated: each round starts one run later, so no contender always follows the same one.
        labels = list(runs)[round_ % len(runs):] + list(runs)[:round_ % len(runs)]
        for label in labels:
            result = runs[label]()
            if isinstance(result, list):  # DDP's reports, by rank
                step, rss = result[0]["step_s"], [report["peak_rss_mb"] for report in result]
            else:
                step, rss = median_step(result, warmup), result["peak_rss_mb"]
            measured[label].append((step, rss))
            print(f"{name} round {round_ + 1}: {label} step {step:.2f} s, peak RSS {' / '.join(f'{mb:,.0f}' for mb in rss)} MiB",
                  flush=True)  # a run takes minutes at 124M
    step = {label: float(np.median([s for s, _ in results])) for label, results in measured.items()}
    print(f"{name}, 2 ranks x {bf16_config['train']['micro_batch_size']}, median of steps {warmup + 1} to {steps}, "
          f"median of {rounds} rounds: run | step s | DDP + autocast step / this | peak RSS a rank MiB (largest round)")
    for label, results in measured.items():
        rss = [max(mbs) for mbs in zip(*[r for _, r in results])]
        print(f"{name}: {label} | {step[label]:.2f} | {step['DDP + autocast bf16'] / step[label]:.2f}x | "
              f"{' / '.join(f'{mb:,.0f}' for mb in rss)}")
    print(f"{name}: train.zero 1 / 0 at bf16 step {step['ortflow bf16, train.zero 1'] / step['ortflow bf16, train.zero 0']:.2f}x; "
          f"ortflow fp32 / bf16 step {step['ortflow fp32, train.zero 0'] / step['ortflow bf16, train.zero 0']:.2f}x")


def zero_memory(workdir: Path, name: str, steps: int, warmup: int) -> None:
    """ZeRO-1 at 2 ranks: ortflow with train.zero 0 and 1, DDP with AdamW and with
    ZeroRedundancyOptimizer around it, on the same model, batch and steps. For each,
    every rank's peak RSS, the optimizer state it holds (ortflow's computed from the
    trainer's layout, DDP's summed from its optimizer), its weights, gradients and
    optimizer state, and the median step after `warmup` steps; each sharded run's
    peak and state against its unsharded peer's."""
    config = prepare(workdir, name, "build_artifacts", {"log_every": 1, "eval_batches": 1, "eval_batch_size": 8})
    artifacts = workdir / f"results/{name}/artifacts"
    rows = {}
    for zero in (0, 1):
        metrics = ortflow_metrics(workdir, {**config, "train": {**config["train"], "zero": zero}}, 2, steps)
        parameter_bytes, moments = ortflow_state_bytes(artifacts, 2, zero)
        rows[f"ortflow, train.zero: {zero}"] = (metrics["peak_rss_mb"], moments,
                                                [2 * parameter_bytes + m for m in moments], median_step(metrics, warmup))
    for zero in (False, True):
        reports = run_ddp(workdir, config, 2, steps, zero=zero, warmup=warmup)
        rows["DDP, " + ("ZeroRedundancyOptimizer(AdamW)" if zero else "AdamW")] = (
            [r["peak_rss_mb"] for r in reports], [r["optimizer_state_bytes"] for r in reports],
            [2 * r["parameter_bytes"] + r["optimizer_state_bytes"] for r in reports], reports[0]["step_s"])
    print(f"{name}, 2 ranks x {config['train']['micro_batch_size']}, median of steps {warmup + 1} to {steps}: "
          "run | peak RSS a rank MiB | / unsharded | optimizer state a rank MB | weights + gradients + "
          "optimizer state a rank MB | / unsharded | step s")
    labels = list(rows)
    for index, label in enumerate(labels):
        peak, moments, state, step = rows[label]
        peer_peak, _, peer_state, _ = rows[labels[index - index % 2]]  # the unsharded run of its pair
        print(f"{name}: {label} | {' / '.join(f'{mb:,.0f}' for mb in peak)} | "
              f"{' / '.join(f'{mb / peer:.2f}' for mb, peer in zip(peak, peer_peak))} | "
              f"{' / '.join(f'{b / 1e6:,.0f}' for b in moments)} | {' / '.join(f'{b / 1e6:,.0f}' for b in state)} | "
              f"{' / '.join(f'{b / peer:.2f}' for b, peer in zip(state, peer_state))} | {step:.2f}")


def by_task_folders(workdir: Path) -> None:
    """GPT-2 and a BERT encoder at 6 layers, width 384, written by save_pretrained (weights from torch's seed 0)."""
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=6, n_head=6, n_embd=384, n_positions=128, vocab_size=256)) \
        .save_pretrained(workdir / "gpt2-folder")
    BertModel(BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                         intermediate_size=1536, max_position_embeddings=128)).save_pretrained(workdir / "bert-folder")


def by_task(workdir: Path, name: str, rounds: int, steps: int) -> None:
    """The by-task path against the wrapper on the same folder (see the module's docstring)."""
    import onnx

    setup = BY_TASK[name]
    configs = {}
    for way in ("by task", "wrapper"):
        run = f"{name}-{way.replace(' ', '-')}"
        configs[way] = prepare(workdir, run, config={"data": setup["data"], "model": setup[way],
                                                     "train": setup["train"]})
        graph = onnx.load(str(workdir / f"results/{run}/artifacts/training_model.onnx"), load_external_data=False)
        print(f"{name} {way}: training graph of {len(graph.graph.node)} nodes")
    best = {way: (0.0, []) for way in configs}
    for round_ in range(rounds):
        for way, config in configs.items():
            metrics = ortflow_metrics(workdir, config, 2, steps)
            rate, rss = metrics["samples_per_s"], metrics["peak_rss_mb"]
            print(f"{name} round {round_ + 1} {way}: {rate:.1f} samples/s, peak RSS {', '.join(f'{mb:,.0f}' for mb in rss)} MB")
            if rate > best[way][0]:
                best[way] = (rate, rss)
    (task_rate, task_rss), (wrap_rate, wrap_rss) = best["by task"], best["wrapper"]
    print(f"{name}: by task / wrapper samples/s {task_rate / wrap_rate:.2f}x, peak RSS rank 0 "
          f"{task_rss[0] / wrap_rss[0]:.2f}x ({task_rss[0]:,.0f} / {wrap_rss[0]:,.0f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=[],
                        help="instead of --models: these realistic-size models through every stage, --steps steps")
    parser.add_argument("--zero", nargs="+", choices=[*MODELS, *STAGES], default=[],
                        help="instead of --models: ZeRO-1's memory on these models (train.zero 0 and 1, DDP with "
                             "and without ZeroRedundancyOptimizer), --steps steps")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="with --zero and --bf16: steps left out of the step time")
    parser.add_argument("--by-task", nargs="+", choices=list(BY_TASK), default=[],
                        help="instead of --models: kind transformers against the wrapper on these models")
    parser.add_argument("--bf16", nargs="+", choices=list(STAGES), default=[],
                        help="instead of --models: train.precision bf16 against DDP with autocast bf16 and fp32")
    args = parser.parse_args()
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    # The transformers wrapper, for build_artifacts (PYTHONPATH) and the DDP
    # ranks (spawned processes start from this process's sys.path).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(REPO / "tests"))
    peak = matmul_peak()
    print(f"matmul peak (numpy float32, {len(os.sched_getaffinity(0))} cores): {peak / 1e9:.1f} GFLOP/s")
    with tempfile.TemporaryDirectory(prefix="ortflow-bench-") as tmp:
        workdir = Path(tmp)
        inputs(workdir)
        for name in args.stages:
            stages(workdir, name, args.steps, peak)
        for name in args.zero:
            zero_memory(workdir, name, args.steps, args.warmup)
        for name in args.bf16:
            bf16(workdir, name, args.rounds, args.steps, args.warmup)
        if args.by_task:
            by_task_folders(workdir)
        for name in args.by_task:
            by_task(workdir, name, args.rounds, args.steps)
        for name in [] if args.stages or args.zero or args.by_task or args.bf16 else args.models:
            config = prepare(workdir, name)
            runs = {
                "ortflow W=2": lambda: run_ortflow(workdir, config, 2, args.steps),
                "DDP W=2": lambda: (run_ddp(workdir, config, 2, args.steps)[0]["samples_per_s"], 0.0),
                "DDP W=2 torch default threads":
                    lambda: (run_ddp(workdir, config, 2, args.steps, False)[0]["samples_per_s"], 0.0),
                "ortflow W=1 one core": lambda: run_ortflow(workdir, config, 1, args.steps, one_core=True),
                "ortflow W=1 all cores": lambda: run_ortflow(workdir, config, 1, args.steps),
            }
            best = dict.fromkeys(runs, 0.0)
            flops = 0.0
            for round_ in range(args.rounds):
                measured = {label: run() for label, run in runs.items()}
                print(f"{name} round {round_ + 1}: " + ", ".join(f"{k} {v[0]:,.0f}" for k, v in measured.items()))
                best = {k: max(best[k], measured[k][0]) for k in best}
                flops = max(flops, measured["ortflow W=2"][1])
            print(f"{name} best samples/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in best.items()))
            print(
                f"{name}: ortflow/DDP {best['ortflow W=2'] / best['DDP W=2']:.2f}x "
                f"(against DDP with torch's default threads {best['ortflow W=2'] / best['DDP W=2 torch default threads']:.2f}x); "
                f"scaling efficiency W=2 over 2 x (W=1 on one core) {best['ortflow W=2'] / (2 * best['ortflow W=1 one core']):.2f}; "
                f"W=2 over W=1 on all cores {best['ortflow W=2'] / best['ortflow W=1 all cores']:.2f}x; "
                f"achieved {flops / 1e9:.1f} GFLOP/s = {flops / peak:.2f} of the matmul peak"
            )


if __name__ == "__main__":
    main()
