"""ortflow's own ONNX Runtime operators, compiled from their C++ source in this package by
the system's C++ compiler the first time a process asks for them (no binary ships with
ortflow), against the headers and libraries of the installed torch wheel.

`library()` is the path of the shared library that defines them (operators.cc says what
each computes): `ortflow.BF16MatMul` and `ortflow.FastGeluGrad`, for
`SessionOptions.register_custom_ops_library`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import PreflightError

SOURCE = Path(__file__).with_name("operators.cc")


def cache_folder() -> Path:
    """Where compiled operators are kept: they depend on this machine's compiler and torch."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ortflow" / "kernels"


def compiler() -> str:
    found = shutil.which(os.environ.get("CXX", "c++"))
    if found is None:
        raise PreflightError(
            "ortflow's operators (train.precision: bf16) are compiled at first use and no C++ compiler was found "
            "(CXX or c++ on PATH): "
            "install one (Debian: apt-get install g++)")
    return found


@functools.cache
def library() -> Path:
    """The compiled library, built if this source, torch and compiler have not been built together before."""
    import torch

    torch_dir = Path(torch.__file__).parent
    cxx = compiler()
    flags = [
        "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
        # torch's headers must be read with the C++ ABI its libraries were built with.
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10",
        # torch's libraries where the wheel put them: loading the operator does not depend on `import torch` first.
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]
    inputs = [SOURCE.read_bytes(), torch.__version__.encode(), str(torch_dir).encode(), cxx.encode()]
    key = hashlib.sha256(b"\0".join(inputs + [flag.encode() for flag in flags])).hexdigest()[:16]
    library = cache_folder() / key / "operators.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # A name of this process's own: ranks that start together each compile, and the last rename wins whole.
    partial = library.with_name(f"operators.so.{os.getpid()}")
    result = subprocess.run([cxx, str(SOURCE), "-o", str(partial), *flags], capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
        raise PreflightError(
            f"compiling {SOURCE.name} with {cxx} failed: {first}. ortflow's operators need a C++17 compiler "
            f"(g++ 9 or later) and the headers of the installed torch wheel under {torch_dir / 'include'}")
    os.replace(partial, library)
    return library
