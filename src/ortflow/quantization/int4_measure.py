"""export.int4 in the quantize_model stage: a causal LM's export/generation/ quantized to int4
(int4.py) into export/generation-int4/, and its entry of export/metrics.json: the multiplied
weights' bytes, the perplexity over the first eval windows' scored tokens, and greedy tokens/s on
one thread, of fp32 and int4 side by side; then int8's quality gate on the perplexity (gate.py),
whose refusal keeps the run green unless export.gate_fails_run.

The perplexity is over a bounded number of eval windows (PERPLEXITY_RECORDS): each window is one
prompt step of the decoder, so a large model's measure stays seconds, not minutes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..errors import MissingInputError
from ..generation import GENAI_CONFIG, MODEL
from ..generation.generate import Decoder, generate
from ..models import IGNORE_INDEX
from ..models import TEXT_WINDOWS
from . import gate
from .int4 import Int4, decoder_losses, quantize_folder, weight_bytes

log = logging.getLogger("ortflow.quantize")

PERPLEXITY_RECORDS = 16  # eval windows scored
SPEED_PROMPT = 8  # the first tokens of the first eval window: the timed generation's prompt
SPEED_TOKENS = 16  # greedy new tokens timed, fewer where the model's positions leave less room
SPEED_ROUNDS = 3  # each model's best round counts: the least disturbed by the machine's load


def settings(int4_cfg) -> Int4:
    """The Int4 of the config section export.int4."""
    return Int4(int4_cfg.block_size, int4_cfg.symmetric, int4_cfg.accuracy_level, int4_cfg.output_layer)


def perplexity(decoder: Decoder, windows: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
    """(perplexity, tokens scored) of the `windows` [records, context] whose next tokens the
    `labels` (the windows shifted by one) score, IGNORE_INDEX (padding, a prompt) left out; the
    last label, the token after the window, is outside what the window can predict."""
    losses = []
    for ids, targets in zip(windows, labels):
        ids = ids[:decoder.context_length]
        losses.append(decoder_losses(decoder, ids.tolist())[targets[:len(ids) - 1] != IGNORE_INDEX])
    scored = np.concatenate(losses)
    return float(np.exp(scored.mean())), len(scored)


def tokens_per_s(decoders: dict[str, Decoder], prompt: list[int]) -> dict[str, float]:
    """Greedy tokens a second from `prompt` (prompt step included), each decoder's best of
    SPEED_ROUNDS, the decoders in turns so that both see the same load."""
    new = min(SPEED_TOKENS, min(decoder.context_length for decoder in decoders.values()) - len(prompt))
    for decoder in decoders.values():  # warm-up: allocations, caches
        generate(decoder, [prompt], 1)
    best = dict.fromkeys(decoders, 0.0)
    for _ in range(SPEED_ROUNDS):
        for name, decoder in decoders.items():
            started = time.perf_counter()
            tokens = generate(decoder, [prompt], new)[0]
            best[name] = max(best[name], len(tokens) / (time.perf_counter() - started))
    return best


def remedies(chosen: Int4) -> list[str]:
    """What may bring int4 within the gate, of the settings not set already."""
    found = [f"export.int4.block_size: {Int4.block_size // 2}"] if chosen.block_size > Int4.block_size // 2 else []
    found += ["export.int4.symmetric: false"] if chosen.symmetric else []
    found += ["export.int4.output_layer: false"] if chosen.output_layer else []
    return [*found, "a larger export.max_accuracy_drop", "or export.int4: null"]


def compare(folders: dict[str, Path], batch: dict, label_name: str) -> dict:
    """{fp32: {...}, int4: {...}}: each folder's weight bytes, perplexity and tokens/s."""
    decoders = {name: Decoder(folder, threads=1) for name, folder in folders.items()}
    speeds = tokens_per_s(decoders, batch[TEXT_WINDOWS][0][:SPEED_PROMPT].tolist())
    entry = {}
    for name, decoder in decoders.items():
        value, scored = perplexity(decoder, batch[TEXT_WINDOWS], batch[label_name])
        entry[name] = {"weight_bytes": weight_bytes(folders[name] / MODEL), "perplexity": value,
                       "tokens_scored": scored, "tokens_per_s": speeds[name]}
    return entry


def write_int4(export_cfg, generation: Path, target: Path, reader, scratch: Path) -> dict:
    """`target` (export/generation-int4/) from `generation`, built in `scratch` and renamed into place
    once measured and gated; returns metrics.json's int4 entry."""
    if not (generation / GENAI_CONFIG).is_file():
        raise MissingInputError(f"export.int4: {generation} is no generation folder (export_model writes it for a "
                                "model.kind gpt or transformers causal-lm); set export.int4: null for this model")
    chosen = settings(export_cfg.int4)
    built = Path(scratch) / target.name
    count = quantize_folder(generation, built, chosen)
    batch = reader.gather(np.arange(min(PERPLEXITY_RECORDS, len(reader))))
    entry = {"settings": asdict(chosen), "weights_quantized": count, "records": len(batch[TEXT_WINDOWS]),
             **compare({"fp32": generation, "int4": built}, batch, reader.label_name)}
    entry["weight_ratio"] = entry["int4"]["weight_bytes"] / entry["fp32"]["weight_bytes"]
    log.info("int4 %s: weights %.3gx fp32's bytes, perplexity %.5g (fp32 %.5g) over %d tokens of %d eval windows, "
             "%.0f tokens/s (fp32 %.0f) on one thread", target, entry["weight_ratio"], entry["int4"]["perplexity"],
             entry["fp32"]["perplexity"], entry["int4"]["tokens_scored"], entry["records"],
             entry["int4"]["tokens_per_s"], entry["fp32"]["tokens_per_s"])
    entry["gate"] = gate.gate(entry, export_cfg, generation, entry["records"], remedies(chosen), quantized="int4")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(built, target)
    return entry
