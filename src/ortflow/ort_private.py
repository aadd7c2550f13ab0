"""The parts of ONNX Runtime that ortflow reaches although they are not its
public API, in one place. They were read from onnxruntime-training 1.19.2, the
version pyproject.toml pins; another version may have moved or changed them, so
each accessor first checks the installed version and refuses another in one line.

- A CheckpointState's live parameter buffers (`CheckpointState._state.get_parameter`):
  the gradients are summed across ranks and the weight decay applied in place, in
  the memory the Optimizer reads (training/gradients.py).
- The C-level OrtValue behind a Python OrtValue (`OrtValue._ortvalue`), whose
  `numpy()` is a writable view: the doctor's NCCL check sums one in place.
- The flatbuffer classes of ONNX Runtime's checkpoint file
  (`onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs`), which ship in the
  wheel but are not documented: checkpoints are sharded and merged without ORT
  (checkpoints/ort_format.py).
- The exception ORT raises for a node its CPU provider has no kernel for
  (`onnxruntime.capi.onnxruntime_pybind11_state.NotImplemented`): quantize names that node.
"""

from __future__ import annotations

import functools
import importlib

from .errors import PreflightError

VERSION = "1.19.2"


@functools.cache
def check_version() -> None:
    import onnxruntime

    if onnxruntime.__version__ != VERSION:
        raise PreflightError(
            f"onnxruntime {onnxruntime.__version__} is installed; ortflow reaches parts of ONNX Runtime that are not "
            f"its public API, read from {VERSION} (src/ortflow/ort_private.py): "
            f"pip install onnxruntime-training=={VERSION}")


def parameter(state, name: str):
    """The C-level parameter `name` of the CheckpointState `state`: `.data` and `.grad`
    are ORT's live buffers (OrtValues), which the Module and Optimizer read."""
    check_version()
    return state._state.get_parameter(name)


def c_ortvalue(value):
    """The C-level OrtValue of a Python `onnxruntime.OrtValue`."""
    check_version()
    return value._ortvalue


def checkpoint_schema(name: str):
    """The flatbuffer module `name` (Checkpoint, Tensor, ModuleState, ...) of ORT's checkpoint file."""
    check_version()
    return importlib.import_module(f"onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.{name}")


def not_implemented_error() -> type:
    """The exception an InferenceSession raises for a node without a kernel."""
    check_version()
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplementedByOrt

    return NotImplementedByOrt
