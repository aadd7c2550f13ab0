"""Checkpoint save throughput per rank, against a plain write of the same number of bytes.

Builds training artifacts for an MLP (AdamW) of about `--megabytes` of parameters,
then starts `--ranks` MPI ranks. Each rank takes one optimizer step (so that the
AdamW moments are not zeros), then, `--repeats` times, with a barrier before each:

- save: what the training loop does (`checkpointer.live_part`, this rank's part as
  views of ORT's live parameter buffers and of the moments the rank holds, then
  `ortflow.checkpoints.writer.save`: the HDF5 shard written from those arrays to its
  temporary file, read back once to hash it (sha256) while it is fsynced, renamed;
  then the manifest and the COMPLETE marker by rank 0);
- plain: the same number of bytes as this rank's shard, from memory, written to
  a file in the same folder, fsynced, renamed.

Throughput is the shard's bytes over the time, per rank; the median of the repeats.
Parameters plus both AdamW moments make a checkpoint 3x the parameters' size.
Then `ortflow checkpoint merge` of the last checkpoint, in its own process: its wall
time and peak RSS (from wait4), against the checkpoint's state S.

    python bench/bench_checkpoint.py --megabytes 100 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def build_artifacts(out: Path, megabytes: int) -> None:
    """An MLP 64 -> h -> h -> 10 with about `megabytes` of float32 parameters."""
    import onnx
    import torch
    from onnxruntime.training import artifacts

    from ortflow.sessions import quiet_logging

    quiet_logging()
    hidden = int(((megabytes * 2**20 / 4) ** 0.5))
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    base = out / "base.onnx"
    torch.onnx.export(model, (torch.zeros(2, 64),), str(base), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, opset_version=16,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
    onnx_model = onnx.load(str(base))
    names = [init.name for init in onnx_model.graph.initializer]
    artifacts.generate_artifacts(onnx_model, requires_grad=names, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=out)


def plain_write(path: Path, data: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def merge(out: Path) -> dict:
    """`ortflow checkpoint merge` of the newest checkpoint under `out`: its wall time and peak RSS."""
    command = [str(Path(sys.executable).parent / "ortflow"), "checkpoint", "merge", str(out / "checkpoints"),
               str(out / "merged")]
    started = time.perf_counter()
    with open(out / "merge.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"merge failed:\n{(out / 'merge.log').read_text()[-4000:]}")
    return {"seconds": time.perf_counter() - started, "peak_rss_bytes": usage.ru_maxrss * 1024}


def worker(args) -> None:
    from ortflow.artifacts import Artifacts
    from ortflow.checkpoints import layout, writer
    from ortflow.sessions import quiet_logging
    from ortflow.training import engine, sharding
    from ortflow.training.checkpointer import live_part
    from ortflow.training.comm import MPIComm
    from ortflow.training.optimizer import Optimizer
    from ortflow.training.weight_decay import WeightDecay

    quiet_logging()
    comm = MPIComm(args.out / "heartbeat", 600)
    artifacts = Artifacts(args.out / "artifacts")
    state = engine.initial_state(artifacts)
    settings = {"name": "adamw", "lr": 0.001, "weight_decay": 0.0, "no_decay": []}
    module, step = engine.open_sessions(artifacts, state, "cpu", 1, settings, np)
    trainable = engine.trainable(state)
    slices = sharding.layout(state, trainable, 2, comm.world_size, np)
    owned = sharding.for_run({"zero": args.zero}, state, trainable, comm, slices)
    optimizer = Optimizer(state, owned.pieces, settings, np)
    rng = np.random.default_rng(comm.rank)
    module.train()
    module(rng.random((16, 64), dtype=np.float32), rng.integers(0, 10, 16).astype(np.int64))
    optimizer.step(0.001, step, WeightDecay({}, [], settings))

    root = args.out / "checkpoints"
    save_s, plain_s = [], []
    for repeat in range(args.repeats):
        comm.barrier()
        started = time.perf_counter()
        part = live_part(state, slices[comm.rank], set(trainable), optimizer, np)
        folder = writer.save(root, repeat + 1, part, comm, {"bench": True}, "bench", {"step": repeat + 1}, 1)
        save_s.append(time.perf_counter() - started)
    shard = folder / layout.shard_name(comm.rank, comm.world_size)
    shard_bytes = shard.stat().st_size
    payload = np.random.default_rng(0).integers(0, 255, shard_bytes, dtype=np.uint8)
    for repeat in range(args.repeats):
        comm.barrier()
        started = time.perf_counter()
        plain_write(folder / f"plain-{comm.rank}.bin", payload)
        plain_s.append(time.perf_counter() - started)
    results = comm.allgather({"rank": comm.rank, "shard_bytes": shard_bytes, "save_s": statistics.median(save_s),
                              "plain_s": statistics.median(plain_s)})
    if comm.rank == 0:
        print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100, help="parameters, in MiB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--zero", type=int, choices=(0, 1), default=0, help="train.zero of the ranks")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from ortflow.launcher import launcher_command, launcher_env

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = Path(tmp)
        (out / "artifacts").mkdir()
        build_artifacts(out / "artifacts", args.megabytes)
        command = launcher_command("mpirun", args.ranks, os.cpu_count() or 1) + [
            sys.executable, __file__, "--worker", "--out", str(out), "--repeats", str(args.repeats), "--zero", str(args.zero)]
        output = subprocess.run(command, env=launcher_env(os.environ), capture_output=True, text=True)
        if output.returncode:
            raise SystemExit(f"the ranks failed:\n{output.stderr[-4000:]}")
        results = json.loads(output.stdout.strip().splitlines()[-1])
        merged = merge(out)
    total = sum(r["shard_bytes"] for r in results)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.ranks} ranks, "
          f"checkpoint {total / 2**20:.1f} MiB (parameters + AdamW moments), median of {args.repeats}")
    print("| rank | shard MiB | save s | save MiB/s | plain write s | plain MiB/s | save / plain |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        mib = r["shard_bytes"] / 2**20
        print(f"| {r['rank']} | {mib:.1f} | {r['save_s']:.3f} | {mib / r['save_s']:.0f} | {r['plain_s']:.3f} | "
              f"{mib / r['plain_s']:.0f} | {r['save_s'] / r['plain_s']:.2f}x |")
    print(f"merge: {merged['seconds']:.1f} s, peak RSS {merged['peak_rss_bytes'] / 2**20:.0f} MiB, "
          f"{merged['peak_rss_bytes'] / total:.2f}x the checkpoint's {total / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
