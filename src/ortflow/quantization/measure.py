"""The fp32 and int8 models measured side by side: each evaluated on the whole eval split
(the loss and accuracy or perplexity that training reports) and timed on ONE intra-op
thread at batch 1 and 64 (p50 and p95 over interleaved rounds, so that both see the same
machine load; fewer than 64 where their activations would not fit: `latency_batches`);
and the table of quality, latency and size that compares them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from ..evaluation import batch_totals, eval_results
from ..graphs.description import ModelDescription
from ..inference import input_feeds, loss_of
from ..machine import available_memory
from ..sessions import inference_session

log = logging.getLogger("ortflow.quantize")

# The batches timed: one record, and LATENCY_BATCH where the activations fit (latency_batches).
LATENCY_BATCH = 64
LATENCY_ROUNDS = 20
LATENCY_RUNS_PER_ROUND = 10
# A large model gets fewer rounds rather than minutes of timing; never fewer than MIN_ROUNDS.
LATENCY_BUDGET_S = 10.0
MIN_ROUNDS = 3


def evaluate(path: Path, reader, info: ModelDescription, batch_size: int) -> dict:
    """What training's evaluation reports (`evaluation.eval_results`), for an inference model."""
    logits_name = info.outputs.logits
    session = inference_session(path, also=(logits_name,), prepacked=False)
    totals = np.zeros(3)
    for batch in reader.eval_batches(0, 1, batch_size):
        logits = session.run([logits_name], input_feeds(session, batch))[0]
        labels = batch[reader.label_name]
        totals += batch_totals(loss_of(logits, labels, info.loss), logits, labels, info)
    return eval_results(totals, info.task)


def latency_batches(info: ModelDescription, sessions: int) -> tuple[int, ...]:
    """(1, LATENCY_BATCH), or a second batch as large as fits (none where one record is all that
    fits, rather than timing batch 1 twice): `sessions` sessions timed side by
    side, each holding what model.json's eval_bytes_per_sample says an evaluation holds per
    record, within half the memory available (machine.available_memory: MemAvailable, the
    cgroup's limit or ORTFLOW_MEMORY_AVAILABLE), the rest for the weights and ONNX Runtime's
    arenas, which hold more than that ideal node-by-node count."""
    per_record = sessions * info.eval_bytes_per_sample
    if not per_record:  # artifacts built before evaluations were counted
        return 1, LATENCY_BATCH
    available, where = available_memory()
    fits = max(1, min(LATENCY_BATCH, int(available / 2 // per_record)))
    if fits < LATENCY_BATCH:
        log.info("latency timed at batch 1%s, not %d: %d session(s) of %.0f MB a record in half the %.1f GiB "
                 "available (%s)", f" and {fits}" if fits > 1 else " alone", LATENCY_BATCH, sessions,
                 per_record / sessions / 1e6, available / 2**30, where)
    return (1, fits) if fits > 1 else (1,)


def latencies(paths: dict[str, Path], reader, batches: tuple[int, ...]) -> dict[str, dict]:
    """{model: {b1_p50, b1_p95, b64_p50, b64_p95}} in ms on one thread (64: the second of
    `batches`, if there is one), the models timed in turns."""
    sessions = {name: inference_session(path, threads=1) for name, path in paths.items()}
    indices = np.arange(max(batches)) % len(reader)  # a small eval split repeats records
    out: dict[str, dict] = {name: {} for name in paths}
    for size in batches:
        batch = reader.gather(indices[:size])
        feeds = {name: input_feeds(session, batch) for name, session in sessions.items()}
        times: dict[str, list] = {name: [] for name in paths}
        budget = LATENCY_BUDGET_S / len(batches)
        started = time.perf_counter()
        for name, session in sessions.items():  # warm-up: allocations, caches
            session.run(None, feeds[name])
        # Fewer runs a round where one run of each model takes long (GPT-2 124M: tens of seconds at b64).
        runs = max(1, min(LATENCY_RUNS_PER_ROUND, int(budget / (MIN_ROUNDS * (time.perf_counter() - started)))))
        for name, session in sessions.items():
            for _ in range(runs - 1):
                session.run(None, feeds[name])
        deadline = time.perf_counter() + budget
        for round_ in range(LATENCY_ROUNDS):
            if round_ >= MIN_ROUNDS and time.perf_counter() > deadline:
                break
            for name, session in sessions.items():
                for _ in range(runs):
                    started = time.perf_counter()
                    session.run(None, feeds[name])
                    times[name].append(time.perf_counter() - started)
        for name in paths:
            out[name][f"b{size}_p50"] = float(np.percentile(times[name], 50) * 1e3)
            out[name][f"b{size}_p95"] = float(np.percentile(times[name], 95) * 1e3)
    return out


def table(report: dict) -> str:
    """The report as rows of quality, latency and size, with how int8 compares."""
    from tabulate import tabulate

    fp32, int8 = report["fp32"], report.get("int8")
    rows = []
    for key in ("loss", "accuracy", "perplexity"):
        if key in fp32:
            scale = 100 if key == "accuracy" else 1
            change = [f"{(int8[key] - fp32[key]) * scale:+.4g}"] if int8 else []
            rows.append([f"{key} (%)" if key == "accuracy" else key, fp32[key] * scale,
                         *([int8[key] * scale] if int8 else []), *change])
    for key, value in fp32["latency_ms"].items():
        quantized = int8["latency_ms"][key] if int8 else None
        change = [f"{value / quantized:.2f}x faster"] if int8 else []
        rows.append([f"latency {key} (ms, 1 thread)", value, *([quantized] if int8 else []), *change])
    size = [f"{fp32['size_bytes'] / int8['size_bytes']:.2f}x smaller"] if int8 else []
    rows.append(["size (KiB)", fp32["size_bytes"] / 1024, *([int8["size_bytes"] / 1024] if int8 else []), *size])
    headers = ["", "fp32", "int8", "int8 vs fp32"] if int8 else ["", "fp32"]
    return tabulate(rows, headers=headers, floatfmt=".4g")
