"""Communication between ranks, behind one small interface.

`MPIComm` sums gradients in place with mpi4py (CPU buffers); `NCCLComm` sums
them on the GPU with CuPy's NCCL bindings, through the device addresses of ORT's
gradient buffers. Both use MPI to start up and for the small reductions of
metrics. A watchdog thread ends the run when a collective does not finish in
time, naming the rank that is behind, instead of hanging forever.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("ortflow.train")

# Gradients are packed into buckets of about this size, so that a step makes a
# few large all-reduce calls rather than one per tensor (PyTorch DDP uses 25 MB).
BUCKET_BYTES = 25 * 1024 * 1024


# The phases of a step, in order, as ranks report them in their heartbeats.
PHASES = ("forward", "allreduce", "eval", "checkpoint")


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
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "phase": phase, "time": time.time()}))
        os.replace(tmp, self.path)

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
                beat = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            rank = int(path.stem.split("-")[1])
            progress = (beat["step"], PHASES.index(beat["phase"]), beat["time"])
            seen.append((progress, rank, beat))
        if not seen:
            return "no rank has reported progress"
        # The rank that is furthest behind in the step's order of phases, not
        # the one that wrote last: a slow rank may write "forward" after a fast
        # one already wrote "allreduce" of the same step.
        _, rank, beat = min(seen)
        step, phase, when = beat["step"], beat["phase"], beat["time"]
        return f"rank {rank} is behind: last seen at step {step} ({phase}) {time.time() - when:.0f}s ago"

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
    """Data-parallel communication over MPI (mpi4py), on CPU buffers."""

    def __init__(self, heartbeat_dir: Path, timeout_s: float):
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.rank, self.world_size = self.world.Get_rank(), self.world.Get_size()
        node = self.world.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.watchdog = Watchdog(self.world, heartbeat_dir, timeout_s)
        self._buckets: dict[int, np.ndarray] = {}  # reused packing buffers, by bucket

    def allreduce_gradients(self, grads: list[np.ndarray]) -> None:
        """Sum `grads` (writable views of ORT's gradient buffers) across ranks, in place."""
        if self.world_size == 1:
            return
        for bucket_index, group in enumerate(_buckets(grads)):
            if len(group) == 1:
                with self.watchdog.collective("allreduce(gradients)"):
                    self.world.Allreduce(self.MPI.IN_PLACE, group[0])
                continue
            size = sum(g.size for g in group)
            if self._buckets.get(bucket_index, np.empty(0)).size < size:
                self._buckets[bucket_index] = np.empty(size, dtype=np.float32)
            flat = self._buckets[bucket_index][:size]
            offset = 0
            for g in group:
                flat[offset:offset + g.size] = g.reshape(-1)
                offset += g.size
            with self.watchdog.collective("allreduce(gradients)"):
                self.world.Allreduce(self.MPI.IN_PLACE, flat)
            offset = 0
            for g in group:
                g.reshape(-1)[:] = flat[offset:offset + g.size]
                offset += g.size

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


def _buckets(grads: list[np.ndarray]):
    group, size = [], 0
    for g in grads:
        if group and size + g.nbytes > BUCKET_BYTES:
            yield group
            group, size = [], 0
        group.append(g)
        size += g.nbytes
    if group:
        yield group


class NCCLComm(MPIComm):
    """Gradients summed on the GPU by NCCL (through CuPy), in place on ORT's
    device buffers; MPI starts the communicator and reduces the metrics."""

    def __init__(self, heartbeat_dir: Path, timeout_s: float):
        super().__init__(heartbeat_dir, timeout_s)
        cupy = require_cupy()
        from cupy.cuda import nccl

        self.cupy, self.nccl = cupy, nccl
        cupy.cuda.Device(gpu_for(self.local_rank, os.environ)).use()
        unique_id = nccl.get_unique_id() if self.rank == 0 else None
        unique_id = self.world.bcast(unique_id, root=0)
        self.nccl_comm = nccl.NcclCommunicator(self.world_size, unique_id, self.rank)

    def allreduce_gradients(self, grads) -> None:
        """`grads` are OrtValues on the device: sum them in place through their addresses."""
        if self.world_size == 1:
            return
        stream = self.cupy.cuda.Stream.null.ptr
        with self.watchdog.collective("nccl allreduce(gradients)"):
            self.nccl.groupStart()
            for g in grads:
                count = int(np.prod(g.shape()))
                ptr = g.data_ptr()
                self.nccl_comm.allReduce(ptr, ptr, count, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM, stream)
            self.nccl.groupEnd()
            self.cupy.cuda.Stream.null.synchronize()


class DeviceError(RuntimeError):
    """The configured device or backend cannot run on this machine."""


def require_cupy():
    try:
        import cupy
    except ImportError:
        raise DeviceError(
            "train.device is cuda but CuPy is not installed: pip install -e '.[cuda]' "
            "(cupy-cuda12x), or set train.device: cpu"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise DeviceError(f"train.device is cuda but no CUDA GPU is usable here ({error}); set train.device: cpu") from None
    if count == 0:
        raise DeviceError("train.device is cuda but this node has no GPU; set train.device: cpu")
    return cupy


def gpu_for(local_rank: int, environ: dict) -> int:
    """The GPU of a rank: its local rank among the GPUs it can see. Some clusters
    show each task all of the node's GPUs, others only its own (one visible
    device), so wrap around the visible ones."""
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return local_rank % len(visible) if visible else local_rank


def backend_for(train: dict) -> str:
    """`train.backend: auto` is nccl on cuda and mpi on cpu."""
    if train["backend"] != "auto":
        return train["backend"]
    return "nccl" if train["device"] == "cuda" else "mpi"


def create(train: dict, heartbeat_dir: Path):
    backend = backend_for(train)
    comm_class = NCCLComm if backend == "nccl" else MPIComm
    return comm_class(heartbeat_dir, train["collective_timeout_s"])
