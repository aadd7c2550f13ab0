"""Faults injected on purpose, for the tests of what a real run survives: one rank
raises, stalls or feeds NaNs at a chosen step. Set by the environment variable
ORTFLOW_FAULT (JSON: {"step": S, "rank": R, "mode": "raise" | "stall" | "nan"}),
which mpirun and srun pass on to the ranks; it is not part of the user's config."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

from ..errors import TrainingError

log = logging.getLogger("ortflow.train")

ENV = "ORTFLOW_FAULT"
MODES = ("raise", "stall", "nan")


class Fault:
    """The fault of this rank, if the environment asks for one."""

    def __init__(self, environ=os.environ):
        spec = environ.get(ENV)
        self.fault = json.loads(spec) if spec else None
        if self.fault is not None and (set(self.fault) != {"step", "rank", "mode"} or self.fault["mode"] not in MODES):
            raise TrainingError(f"{ENV}={spec!r}: expected {{\"step\": S, \"rank\": R, \"mode\": one of {MODES}}}")

    def inject(self, step: int, rank: int, batches: list[dict], stop) -> None:
        """Break rank `rank` at optimizer step `step` (0-based), as the fault says."""
        if not self.fault or self.fault["step"] != step or self.fault["rank"] != rank:
            return
        mode = self.fault["mode"]
        if mode == "raise":
            raise TrainingError(f"injected failure on rank {rank} at step {step} ({ENV})")
        if mode == "stall":  # for an hour, or until asked to stop
            log.warning("rank %d stalls at step %d (%s)", rank, step, ENV)
            until = time.monotonic() + 3600
            while stop.reason is None and time.monotonic() < until:
                time.sleep(0.1)
        if mode == "nan":
            for batch in batches:
                for value in batch.values():
                    if value.dtype.kind == "f":
                        value[...] = np.nan
