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
- The AdamW block's operator attributes (`AdamWOptimizer._build_optimizer_node`,
  `AdamW._adamw`): build_artifacts asks for torch's AdamW (adam_mode 0).
- The shape inference that ONNXQuantizer runs for dynamic quantization by saving the
  model and reading it back (`onnx_quantizer.save_and_reload_model_with_shape_infer`):
  quantize runs the same inference on the graph alone, not holding every weight twice.
- The counter onnxblock names the nodes it adds from (`_graph_utils._GRAPH_TOKEN`,
  `generate_graph_name`): build_artifacts restarts it, so that the graphs depend on
  the model alone, and ortflow's own loss blocks name their nodes by it (models/losses.py).
- The check that `import onnxruntime` runs on the training package
  (`capi/onnxruntime_validation.py` imports `onnxruntime.training.ortmodule`, and so
  torch and sympy): ortflow never uses ORTModule, and its processes skip it
  (`skip_ortmodule`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from pathlib import Path

from .errors import PreflightError

VERSION = "1.19.2"
ORTMODULE = "onnxruntime.training.ortmodule"


def skip_ortmodule() -> None:
    """Make ORTModule (ONNX Runtime's torch front-end, unused by ortflow) fail to import in this
    process, before onnxruntime is imported: onnxruntime's import then skips the check that imports
    it, with torch and sympy, which cost each stage process 2.4 s of CPU (export and quantize need
    neither; onnxruntime.training, which catches the ImportError, then imports torch alone). Only the
    check's warning about a CUDA runtime that differs from the build's is lost: the doctor checks
    the CUDA libraries itself (cuda_libraries.py). For the entry points of ortflow's own processes."""
    if "onnxruntime" not in sys.modules:
        sys.modules.setdefault(ORTMODULE, None)


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
    import onnxruntime

    # Imported by the top-level name that the schema's modules import each other by, from the folder
    # that ORT's ort_format_model puts on sys.path: through onnxruntime.tools, whose __init__ imports
    # torch, it cost the checkpoint merge and export 1.2 s of CPU for nothing.
    folder = str(Path(onnxruntime.__file__).parent / "tools" / "ort_format_model")
    if folder not in sys.path:
        sys.path.append(folder)
    return importlib.import_module(f"ort_flatbuffers_py.fbs.{name}")


def not_implemented_error() -> type:
    """The exception an InferenceSession raises for a node without a kernel."""
    check_version()
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplementedByOrt

    return NotImplementedByOrt


def torch_adamw_block(betas: tuple[float, float], eps: float):
    """onnxblock's AdamW with torch.optim.AdamW's arithmetic (adam_mode 0; the block's
    default is Hugging Face's, which places epsilon and the weight decay differently)
    and no weight decay (training applies it per group)."""
    check_version()
    from onnxruntime.training.onnxblock import optim

    class TorchAdamW(optim.optim.AdamWOptimizer):
        def _build_optimizer_node(self, input_names, output_name, node_name, node_attributes):
            return super()._build_optimizer_node(input_names, output_name, node_name,
                                                 {**node_attributes, "adam_mode": 0})

    block = optim.AdamW(betas=betas, eps=eps, weight_decay=0.0)
    block._adamw = TorchAdamW(betas=betas, eps=eps, weight_decay=0.0)
    return block


def restart_node_names() -> None:
    """Restart the process-wide counter that onnxblock names new nodes from."""
    check_version()
    from onnxruntime.training import onnxblock

    onnxblock._graph_utils._GRAPH_TOKEN = 0


def new_node_name(prefix: str) -> str:
    """A node name no other node of the graphs onnxblock builds has, as its own blocks name theirs."""
    check_version()
    from onnxruntime.training.onnxblock import _graph_utils

    return _graph_utils.generate_graph_name(prefix)


@contextlib.contextmanager
def dynamic_quantizer_reads_weights_once():
    """Within it, ONNXQuantizer (dynamic) infers its model's shapes on the graph alone. It
    saves the model given, every initializer of 1 KiB or more to external data, infers
    shapes on that file and reads the model back: a second copy of every weight, while
    protobuf keeps the first one's memory (a message's is freed with the message, which
    quantize_dynamic holds): 2.5 times the weights at its peak. Here ONNX's same shape
    inference runs on the graph as that file has it (those initializers without their
    bytes), and what it infers (value_info, inputs, outputs) is written into the model given."""
    check_version()
    from onnxruntime.quantization import onnx_quantizer

    reload = onnx_quantizer.save_and_reload_model_with_shape_infer
    onnx_quantizer.save_and_reload_model_with_shape_infer = infer_shapes_in_place
    try:
        yield
    finally:
        onnx_quantizer.save_and_reload_model_with_shape_infer = reload


def infer_shapes_in_place(model):
    """`model` with ONNX's shape inference done on its graph as save_and_reload_model_with_shape_infer
    saves it (onnx.save_model with save_as_external_data: a tensor whose raw bytes take 1 KiB
    or more, as sys.getsizeof counts them, written out), and ONNX Runtime's inference metadata."""
    import sys

    import onnx
    from onnxruntime.quantization.quant_utils import add_infer_metadata

    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, skip="graph")
    copy_fields(model.graph, skeleton.graph, skip="initializer")
    for tensor in model.graph.initializer:
        if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= 1024:
            stub = skeleton.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                                                  data_location=onnx.TensorProto.EXTERNAL)
            stub.external_data.add(key="location", value="weights")
        else:
            skeleton.graph.initializer.add().CopyFrom(tensor)
    inferred = onnx.shape_inference.infer_shapes(skeleton).graph
    for field in ("value_info", "input", "output"):
        getattr(model.graph, field).clear()
        getattr(model.graph, field).extend(getattr(inferred, field))
    add_infer_metadata(model)
    return model


def copy_fields(source, target, skip: str) -> None:
    """Every field set in the protobuf message `source` but `skip`, copied into `target`."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)
