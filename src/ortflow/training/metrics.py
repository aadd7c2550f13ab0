"""What a run reports: log lines with ETA, TensorBoard scalars and histograms,
and the summary in metrics.json. Only rank 0 writes; every rank measures."""

from __future__ import annotations

import logging
import math
import resource
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .run_summary import RunSummary, write_run_summary
from .schedule import is_time

log = logging.getLogger("ortflow.train")

# Steps left out of the steady-state throughput: the first ones pay for
# session warm-up and memory allocation.
WARMUP_STEPS = 5


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Metrics:
    """Decides when to log (train.log_every, train.histogram_every) and keeps the
    run's history; rank 0 (`enabled`) writes it to the log, TensorBoard and metrics.json."""

    def __init__(self, tensorboard: Path, enabled: bool, start_step: int, train_cfg, global_batch: int,
                 history: dict | None = None):
        """`history`: what the run logged before `start_step` (kept in the checkpoint resumed from)."""
        self.enabled, self.start_step, self.total_steps = enabled, start_step, train_cfg.steps
        self.global_batch = global_batch
        self.log_every, self.histogram_every = train_cfg.log_every, train_cfg.histogram_every
        self.step_times: list[float] = []  # of this attempt
        self.history: dict[str, list] = history or {"train": [], "eval": []}
        self.started = time.perf_counter()
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run wrote past the step we resume from.
            self.writer = SummaryWriter(str(tensorboard), purge_step=start_step or None)

    def step_time(self, seconds: float) -> None:
        self.step_times.append(seconds)

    def log_step(self, done: int, loss: float, lr: float, grad_norm: float, parameters) -> None:
        """After step `done`: the log line (every train.log_every steps) and the histograms
        of `parameters()` (every train.histogram_every), with this step's throughput."""
        if is_time(done, self.log_every, self.total_steps):
            self.train(done, loss, lr, grad_norm, self.global_batch / self.step_times[-1])
        if done % self.histogram_every == 0 and self.enabled:
            self.histograms(done, parameters())

    def train(self, step: int, loss: float, lr: float, grad_norm: float, samples_per_s: float) -> None:
        """`step`: steps done, counted from 1 as everywhere in metrics, logs and checkpoints."""
        if not self.enabled:
            return
        done_here = step - self.start_step
        remaining = (self.total_steps - step) * (time.perf_counter() - self.started) / max(done_here, 1)
        log.info(
            "step %d/%d loss %.4f lr %.3g grad_norm %.3f %.0f samples/s eta %s",
            step, self.total_steps, loss, lr, grad_norm, samples_per_s, tqdm.format_interval(remaining),
        )
        self.history["train"].append({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                      "samples_per_s": samples_per_s})
        for name, value in (("loss", loss), ("lr", lr), ("grad_norm", grad_norm), ("samples_per_s", samples_per_s)):
            self.writer.add_scalar(f"train/{name}", value, step)

    def eval(self, step: int, results: dict) -> None:
        """The numbers of `results` logged, plotted and kept in the history; the
        summary's `eval` (the last results) keeps the rest, such as `per_class`."""
        if not self.enabled:
            return
        numbers = {k: v for k, v in results.items() if isinstance(v, (int, float))}
        log.info("eval at step %d: %s", step, " ".join(f"{k} {v:.4f}" for k, v in numbers.items()))
        self.history["eval"].append({"step": step, **numbers})
        for name, value in numbers.items():
            self.writer.add_scalar(f"eval/{name}", value, step)

    def histograms(self, step: int, parameters: dict[str, np.ndarray]) -> None:
        if self.enabled:
            for name, value in parameters.items():
                self.writer.add_histogram(f"parameters/{name}", value, step)

    def summary(self, steps: int, flops_per_sample: float, eval_results: dict, peak_rss_per_rank: list[float]) -> dict:
        """The run's summary for metrics.json, after `steps` steps (train.steps, or fewer after early stopping)."""
        steady = self.step_times[WARMUP_STEPS:] or self.step_times
        p50, p95 = (float(np.percentile(steady, q)) for q in (50, 95)) if steady else (math.nan, math.nan)
        samples_per_s = self.global_batch / float(np.mean(steady)) if steady else math.nan
        train_loss = self.history["train"][-1]["loss"] if self.history["train"] else math.nan
        return {
            "steps": steps,
            "steps_this_attempt": len(self.step_times),
            "train_loss": train_loss,
            "eval": eval_results,
            "samples_per_s": samples_per_s,
            "step_time_p50_s": p50,
            "step_time_p95_s": p95,
            "flops_per_s": samples_per_s * flops_per_sample,
            "peak_rss_mb": tuple(peak_rss_per_rank),
            "global_batch_size": self.global_batch,
            "wall_time_s": time.perf_counter() - self.started,
            "history": self.history,
        }

    def write(self, path: Path, summary: RunSummary) -> None:
        if self.enabled:
            write_run_summary(path, summary)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

