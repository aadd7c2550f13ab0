"""The CUDA libraries that ONNX Runtime's CUDA provider links against, and how
ortflow makes the ones from the `cuda` extra's wheels findable.

onnxruntime-training 1.19.2's `libonnxruntime_providers_cuda.so` is built for
CUDA 11.8 and cuDNN 8; its RUNPATH is /usr/local/cuda-11.8/lib, and ONNX Runtime
1.19 does not look in site-packages. The nvidia-*-cu11 wheels of the `cuda` extra
put these libraries under site-packages/nvidia/<name>/lib/. `preload()` loads
them with RTLD_GLOBAL before the provider is loaded, so that the dynamic loader
finds each of the provider's needed libraries already loaded (by its soname):
the user sets no LD_LIBRARY_PATH, under mpirun or srun alike.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

# The provider's needed CUDA libraries (`readelf -d`), in an order in which
# each one's own needs are loaded before it, with the wheel that carries it.
PROVIDER_LIBRARIES = {
    "libcudart.so.11.0": "nvidia-cuda-runtime-cu11",
    "libcublasLt.so.11": "nvidia-cublas-cu11",
    "libcublas.so.11": "nvidia-cublas-cu11",
    "libcurand.so.10": "nvidia-curand-cu11",
    "libcufft.so.10": "nvidia-cufft-cu11",
    "libcudnn.so.8": "nvidia-cudnn-cu11",
}

PROVIDER = "libonnxruntime_providers_cuda.so"


def provider_path() -> Path:
    """ONNX Runtime's CUDA provider library (found without importing onnxruntime)."""
    import importlib.util

    return Path(importlib.util.find_spec("onnxruntime").origin).parent / "capi" / PROVIDER


def wheel_library_dirs() -> list[Path]:
    """The lib/ folders of the nvidia-* wheels in this environment."""
    dirs = []
    for entry in sys.path:
        dirs += sorted(Path(entry).glob("nvidia/*/lib")) if entry else []
    return dirs


def wheel_library(soname: str) -> Path | None:
    return next((d / soname for d in wheel_library_dirs() if (d / soname).exists()), None)


def missing() -> list[str]:
    """The provider's needed libraries that the dynamic loader would not find,
    with the wheels' folders added to its search (what `preload` achieves):
    `ldd`'s "not found" lines."""
    search = [str(d) for d in wheel_library_dirs()] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(search))
    output = subprocess.run(["ldd", str(provider_path())], capture_output=True, text=True, env=env).stdout
    return re.findall(r"^\s*(\S+) => not found", output, re.M)


def pip_command(sonames: list[str]) -> str:
    """The install that provides `sonames`: the `cuda` extra, whose pins say which versions carry them."""
    wheels = sorted({PROVIDER_LIBRARIES.get(name, name) for name in sonames})
    return f"pip install 'ortflow[cuda]' (it pins {', '.join(wheels)})"


def preload() -> list[Path]:
    """Load the provider's CUDA libraries from the wheels, where they are there,
    so that ONNX Runtime's later dlopen of the provider resolves them. A library
    not in a wheel is left to the system's loader (a site's CUDA 11.8 install)."""
    loaded = []
    for soname in PROVIDER_LIBRARIES:
        path = wheel_library(soname)
        if path is not None:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            loaded.append(path)
    return loaded
