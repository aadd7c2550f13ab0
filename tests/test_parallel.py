"""The pieces of the training stage that decide placement and communication,
checked without starting a run: threads, GPUs, launcher commands, buckets,
schedules, the cuda path's errors where there is no GPU."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import run_on_ranks
from ortflow.errors import DeviceError
from ortflow import train
from ortflow.training import comm, gradients, schedule, trainer


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
    assert trainer.threads_per_rank(local_size, affinity, environ) == expected


@pytest.mark.parametrize(
    "local_rank, visible, expected",
    [(0, None, 0), (3, None, 3), (1, "0,1,2,3", 1), (1, "5", 0), (5, "2,3", 1)],
)
def test_rank_to_gpu(local_rank, visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert comm.gpu_for(local_rank, environ) == expected


def test_backend_follows_device():
    assert comm.backend_for({"backend": "auto", "device": "cuda"}) == "nccl"
    assert comm.backend_for({"backend": "auto", "device": "cpu"}) == "mpi"
    assert comm.backend_for({"backend": "mpi", "device": "cuda"}) == "mpi"


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


def test_launcher_commands():
    assert train.launcher_command("/x/mpirun", 2, 2) == ["/x/mpirun", "-n", "2", "--bind-to", "none"]
    assert train.launcher_command("mpirun", 3, 2)[-1] == "--oversubscribe"
    assert train.launcher_command("srun", 4, 2) == ["srun", "--mpi=pmix", "-n", "4"]
    with pytest.raises(ValueError, match="unknown MPI launcher 'torchrun'"):
        train.launcher_command("torchrun", 2, 2)


def test_buckets_cover_every_gradient_once(monkeypatch):
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 1000)
    grads = [np.zeros(n, dtype=np.float32) for n in (10, 60, 5, 100, 400, 1)]
    groups = list(gradients.buckets(grads))
    assert [len(g) for g in groups] == [4, 1, 1]
    assert sum(len(g) for g in groups) == len(grads)
    assert all(sum(x.nbytes for x in g) <= 1000 or len(g) == 1 for g in groups)


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


@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "polynomial"])
def test_schedules_warm_up_then_decay_to_the_floor(name):
    cfg = {"name": name, "warmup_steps": 10, "min_lr_ratio": 0.1, "power": 2.0}
    rates = [schedule.learning_rate(s, 100, 1.0, cfg) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(rates[:10], rates[1:10]))
    if name == "constant":
        assert rates[-1] == 1.0
    else:
        assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
        assert 0.1 <= rates[-1] < 0.15
    if name == "cosine":
        assert rates[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # half way down


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
