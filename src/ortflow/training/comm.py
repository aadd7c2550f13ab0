"""Communication between ranks, behind one small interface.

Both sum the gradients in place, packed into buckets by `gradients.allreduce_in_buckets`
(the same lines on both devices); they differ in the one call that sums a flat
buffer across ranks: `MPIComm` with mpi4py (host buffers; device buffers are
staged through the host), `NCCLComm` on the GPU with CuPy's NCCL bindings. Both
use MPI to start up and for the small reductions of metrics, and MPI (through
the host) for ZeRO-1's reduce-scatter and all-gather of uneven runs, which NCCL
has no call for. A watchdog thread ends the run when a collective does not finish in
time, naming the rank that is behind, instead of hanging forever.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np

from .. import records
from ..errors import DeviceError, TrainingError
from .preflight import FAIL, check_cupy, check_gpus
from .gradients import allreduce_in_buckets

log = logging.getLogger("ortflow.train")

# The phases of a step, in order, as ranks report them in their heartbeats ("schedule": a
# pipeline stage's 1F1B step, whose waits on the other stages come before its all-reduce).
PHASES = ("forward", "schedule", "allreduce", "eval", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Beat:
    """A rank's heartbeat file (heartbeat/rank-<r>.json): where it was last, and when (time.time())."""

    step: int
    phase: str  # one of PHASES
    time: float


def read_beat(path: Path) -> Beat:
    return records.read(Beat, path, TrainingError, "each rank rewrites its own at every step")


def write_beat(path: Path, beat: Beat) -> None:
    # Read only while the run lives: not worth a flush to disk at every step.
    records.write(path, beat, end="", sync=False, indent=None)


class Watchdog:
    """Each rank records where it is (step, phase) in a heartbeat file; a
    thread aborts the job when one collective has waited longer than the
    timeout, and says which rank was last seen where."""

    def __init__(self, comm, heartbeat_dir: Path, timeout_s: float):
        self.comm, self.timeout_s = comm, timeout_s
        self.dir = Path(heartbeat_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank-{comm.Get_rank()}.json"
        self.waiting_since: float | None = None
        self.what = ""
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, step: int, phase: str) -> None:
        write_beat(self.path, Beat(step, phase, time.time()))

    def collective(self, what: str):
        watchdog = self

        class _Scope:
            def __enter__(self):
                watchdog.what, watchdog.waiting_since = what, time.monotonic()

            def __exit__(self, *exc):
                watchdog.waiting_since = None

        return _Scope()

    def report(self) -> str:
        seen = []
        for path in sorted(self.dir.glob("rank-*.json")):
            try:
                beat = read_beat(path)
            except (OSError, TrainingError):  # gone with its attempt, or not a heartbeat: no progress to tell
                continue
            rank = int(path.stem.split("-")[1])
            seen.append(((beat.step, PHASES.index(beat.phase), beat.time), rank, beat))
        if not seen:
            return "no rank has reported progress"
        # The rank that is furthest behind in the step's order of phases, not
        # the one that wrote last: a slow rank may write "forward" after a fast
        # one already wrote "allreduce" of the same step.
        _, rank, beat = min(seen)
        return f"rank {rank} is behind: last seen at step {beat.step} ({beat.phase}) {time.time() - beat.time:.0f}s ago"

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            since = self.waiting_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                log.error(
                    "rank %d: collective %s did not finish within train.collective_timeout_s=%gs; %s",
                    self.comm.Get_rank(), self.what, self.timeout_s, self.report(),
                )
                logging.shutdown()
                self.comm.Abort(3)


class MPIComm:
    """Data-parallel communication over MPI (mpi4py). `xp` is the array module
    of the gradients: numpy, or cupy when they live on the GPU."""

    def __init__(self, heartbeat_dir: Path, timeout_s: float, xp=np):
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.rank, self.world_size = self.world.Get_rank(), self.world.Get_size()
        node = self.world.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.watchdog = Watchdog(self.world, heartbeat_dir, timeout_s)
        self.xp = xp
        if xp is not np:  # cupy allocates the packing buffers on the rank's GPU, where ORT's gradients are
            xp.cuda.Device(gpu_for(self.local_rank, os.environ)).use()
        self._buckets: dict = {}  # reused packing buffers, by bucket

    def allreduce_gradients(self, grads: list) -> None:
        """Sum `grads` (`xp` arrays on ORT's gradient buffers) across ranks, in place."""
        if self.world_size > 1:
            allreduce_in_buckets(grads, self.xp, self.reduce_flat, self._buckets)

    def reduce_flat(self, flat) -> None:
        """Sum one flat buffer across ranks in place. This MPI is not CUDA-aware:
        a device buffer (train.backend: mpi on cuda) goes through the host."""
        host = flat if isinstance(flat, np.ndarray) else flat.get()
        with self.watchdog.collective("allreduce(gradients)"):
            self.world.Allreduce(self.MPI.IN_PLACE, host)
        if host is not flat:
            flat.set(host)

    def reduce_scatter_flat(self, flat, mine, counts: list[int]) -> None:
        """ZeRO-1: sum `flat` across ranks; this rank receives into `mine` its run of the sum,
        the runs of `counts` elements laid end to end in rank order (device buffers through the host)."""
        host = flat if isinstance(flat, np.ndarray) else flat.get()
        received = mine if isinstance(mine, np.ndarray) else np.empty(mine.shape, host.dtype)
        with self.watchdog.collective("reduce_scatter(gradients)"):
            self.world.Reduce_scatter(host, received, counts, op=self.MPI.SUM)
        if received is not mine:
            mine.set(received)

    def allgather_flat(self, mine, flat, counts: list[int]) -> None:
        """ZeRO-1: every rank's run (this rank's is `mine`) of `counts` elements into `flat`, in rank order."""
        sent = mine if isinstance(mine, np.ndarray) else mine.get()
        host = flat if isinstance(flat, np.ndarray) else np.empty(flat.shape, sent.dtype)
        with self.watchdog.collective("allgather(parameters)"):
            self.world.Allgatherv(sent, [host, counts])
        if host is not flat:
            flat.set(host)

    def allreduce_sum(self, values) -> np.ndarray:
        """Sum a small vector of float64 metrics across ranks."""
        array = np.asarray(values, dtype=np.float64).copy()
        if self.world_size > 1:
            with self.watchdog.collective("allreduce(metrics)"):
                self.world.Allreduce(self.MPI.IN_PLACE, array)
        return array

    def allgather(self, obj):
        with self.watchdog.collective("allgather"):
            return self.world.allgather(obj)

    def barrier(self) -> None:
        with self.watchdog.collective("barrier"):
            self.world.Barrier()

    def placement(self) -> str:
        """Where the ranks run, for the log (a collective: every rank calls it):
        `node1: rank 0 (local 0), rank 1 (local 1); node2: rank 2 (local 0), ...`.
        The node-local rank is the one that picks a rank's GPU."""
        nodes: dict[str, list[str]] = {}
        for rank, (host, local_rank) in enumerate(self.allgather((socket.gethostname(), self.local_rank))):
            nodes.setdefault(host, []).append(f"rank {rank} (local {local_rank})")
        return "; ".join(f"{host}: {', '.join(ranks)}" for host, ranks in nodes.items())


class NCCLComm(MPIComm):
    """Gradients summed on the GPU by NCCL (through CuPy), in place on ORT's
    device buffers; MPI starts the communicator and reduces the metrics."""

    def __init__(self, heartbeat_dir: Path, timeout_s: float):
        cupy = require_cupy()
        super().__init__(heartbeat_dir, timeout_s, xp=cupy)
        from cupy.cuda import nccl

        self.nccl = nccl
        unique_id = nccl.get_unique_id() if self.rank == 0 else None
        unique_id = self.world.bcast(unique_id, root=0)
        self.nccl_comm = nccl.NcclCommunicator(self.world_size, unique_id, self.rank)

    def reduce_flat(self, flat) -> None:
        """Sum one flat float32 cupy buffer across ranks in place, on the GPU."""
        stream = self.xp.cuda.Stream.null
        with self.watchdog.collective("nccl allreduce(gradients)"):
            self.nccl_comm.allReduce(flat.data.ptr, flat.data.ptr, flat.size, self.nccl.NCCL_FLOAT32,
                                     self.nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()


def require_cupy():
    """CuPy, where it imports and sees a GPU; else a DeviceError with the preflight check's finding and fix."""
    found = check_cupy()
    failed = found if found.status == FAIL else check_gpus(cupy_ok=True)
    if failed.status == FAIL:
        raise DeviceError(f"train.device is cuda: {failed.name}: {failed.detail}; fix: {failed.fix}")
    import cupy

    return cupy


def gpu_for(local_rank: int, environ: dict) -> int:
    """The GPU of a rank: its local rank among the GPUs it can see. Some clusters
    show each task all of the node's GPUs, others only its own (one visible
    device), so wrap around the visible ones."""
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return local_rank % len(visible) if visible else local_rank


def backend_for(train) -> str:
    """`train.backend: auto` is nccl on cuda and mpi on cpu."""
    if train.backend != "auto":
        return train.backend
    return "nccl" if train.device == "cuda" else "mpi"


def create(train, heartbeat_dir: Path):
    if backend_for(train) == "nccl":
        return NCCLComm(heartbeat_dir, train.collective_timeout_s)
    xp = require_cupy() if train.device == "cuda" else np
    return MPIComm(heartbeat_dir, train.collective_timeout_s, xp)
