"""Where the ranks run and how they talk (ortflow.training.comm): threads per rank, a
rank's GPU, the backend, the cuda path's errors where there is no GPU, the bucketed
all-reduce on real MPI ranks, and the watchdog's report of a stalled rank."""

from __future__ import annotations

import sys

import pytest

from conftest import run_on_ranks
from ortflow.config import load
from ortflow.errors import DeviceError
from ortflow.training import comm, engine


@pytest.mark.parametrize(
    "local_size, affinity, environ, expected",
    [
        (2, 2, {}, 1),  # two ranks share a 2-core node
        (1, 8, {}, 8),
        (3, 2, {}, 1),  # oversubscribed: never zero threads
        (2, 8, {"SLURM_CPUS_PER_TASK": "4"}, 4),  # mpirun-style: affinity is the whole node
        (2, 4, {"SLURM_CPUS_PER_TASK": "4"}, 4),  # srun pinned each task to its 4 CPUs
    ],
)
def test_threads_per_rank(local_size, affinity, environ, expected):
    assert engine.threads_per_rank(local_size, affinity, environ) == expected


@pytest.mark.parametrize(
    "local_rank, visible, expected",
    [(0, None, 0), (3, None, 3), (1, "0,1,2,3", 1), (1, "5", 0), (5, "2,3", 1)],
)
def test_rank_to_gpu(local_rank, visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert comm.gpu_for(local_rank, environ) == expected


def test_backend_follows_device():
    def train(**keys):
        return load(overrides={"train": keys}).train

    assert comm.backend_for(train(backend="auto", device="cuda")) == "nccl"
    assert comm.backend_for(train(backend="auto", device="cpu")) == "mpi"
    assert comm.backend_for(train(backend="mpi", device="cuda")) == "mpi"


def test_cuda_without_cupy_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy not installed, whether or not it is here
    with pytest.raises(DeviceError, match=r"train.device is cuda: CuPy: not importable .*fix: pip install 'ortflow\[cuda\]'"):
        comm.require_cupy()


def test_cuda_without_a_gpu_fails_clearly():
    cupy = pytest.importorskip("cupy", reason="needs CuPy installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("this machine has a GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pass
    with pytest.raises(DeviceError, match="train.device is cuda: GPUs: no GPU: "):
        comm.require_cupy()


@pytest.mark.e2e
def test_bucketed_allreduce_with_real_ranks(tmp_path):
    """Three real MPI ranks: sums in place, across bucket boundaries, in every tensor."""
    result = run_on_ranks(
        tmp_path,
        "import numpy as np, sys\n"
        "from ortflow.training import comm, gradients\n"
        "gradients.BUCKET_BYTES = 64\n"
        f"c = comm.MPIComm({str(tmp_path / 'hb')!r}, 30)\n"
        "grads = [np.full(n, c.rank + 1, dtype=np.float32) for n in (3, 40, 7, 1)]\n"
        "views = [g[:] for g in grads]\n"
        "c.allreduce_gradients(views)\n"
        "assert all((g == 6).all() for g in grads), [g[:3] for g in grads]\n"
        "print('ok', c.rank, c.world_size)\n",
        3,
    )
    assert sorted(result.stdout.split("\n")[:-1]) == ["ok 0 3", "ok 1 3", "ok 2 3"]


def test_watchdog_names_the_rank_furthest_behind(tmp_path):
    """A slow rank may write "forward" after a fast one wrote "allreduce" of
    the same step: the slow one is behind, whatever the clock says."""
    import json

    class OneRank:
        def Get_rank(self):
            return 0

    watchdog = comm.Watchdog(OneRank(), tmp_path, timeout_s=3600)
    (tmp_path / "rank-0.json").write_text(json.dumps({"step": 3, "phase": "allreduce", "time": 10.0}))
    (tmp_path / "rank-1.json").write_text(json.dumps({"step": 3, "phase": "forward", "time": 20.0}))
    (tmp_path / "rank-2.json").write_text(json.dumps({"step": 4, "phase": "forward", "time": 5.0}))
    assert "rank 1 is behind: last seen at step 3 (forward)" in watchdog.report()
