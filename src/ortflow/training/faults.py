"""Faults injected on purpose, for the tests of what a real run survives: one rank
raises, stalls, feeds NaNs or has `ortflow train` sent SIGTERM (Slurm's preemption
signal) at a chosen step. Set by the environment variable ORTFLOW_FAULT (JSON:
{"step": S, "rank": R, "mode": "raise" | "stall" | "nan" | "sigterm"}), which mpirun
and srun pass on to the ranks; it is not part of the user's config.

Step S is the moment before optimizer step S (0-based); the step a run ends at (the
last of train.steps, or early stopping's) is the moment after the ranks' last
collective, before rank 0 writes metrics.json."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import numpy as np

from ..errors import TrainingError

log = logging.getLogger("ortflow.train")

ENV = "ORTFLOW_FAULT"
MODES = ("raise", "stall", "nan", "sigterm")


class Fault:
    """The fault of this rank, if the environment asks for one."""

    def __init__(self, environ=os.environ):
        spec = environ.get(ENV)
        self.fault = json.loads(spec) if spec else None
        if self.fault is not None and (set(self.fault) != {"step", "rank", "mode"} or self.fault["mode"] not in MODES):
            raise TrainingError(f"{ENV}={spec!r}: expected {{\"step\": S, \"rank\": R, \"mode\": one of {MODES}}}")

    def inject(self, step: int, rank: int, batches: list[dict], stop) -> None:
        """Break rank `rank` at step `step` (the moment before it; see the top of this file), as the fault says."""
        if not self.fault or self.fault["step"] != step or self.fault["rank"] != rank:
            return
        mode = self.fault["mode"]
        if mode == "raise":
            raise TrainingError(f"injected failure on rank {rank} at step {step} ({ENV})")
        if mode == "stall":
            log.warning("rank %d stalls at step %d (%s)", rank, step, ENV)
        if mode == "sigterm":  # to `ortflow train`, mpirun's parent (not srun's), which forwards it as SIGUSR1
            import psutil

            log.warning("rank %d sends SIGTERM to ortflow train at step %d (%s)", rank, step, ENV)
            os.kill(psutil.Process(os.getppid()).ppid(), signal.SIGTERM)
        if mode in ("stall", "sigterm"):  # for an hour, or until asked to stop (sigterm: by that SIGUSR1)
            until = time.monotonic() + 3600
            while stop.reason is None and time.monotonic() < until:
                time.sleep(0.1)
        if mode == "nan":
            for batch in batches:
                for value in batch.values():
                    if value.dtype.kind == "f":
                        value[...] = np.nan
