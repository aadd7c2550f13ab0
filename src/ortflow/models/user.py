"""Bring your own model: `model.kind: onnx` (a file) or `torch` (an import path)."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

from ..errors import ModelError

log = logging.getLogger("ortflow.build_artifacts")

# onnxruntime-training 1.19 loads models up to IR version 10, which goes with
# ONNX opsets up to 22 and tensor types up to INT4 (22).
MAX_IR_VERSION = 10
MAX_OPSET_FOR_IR = 22
MAX_ELEM_TYPE_FOR_IR = 22


def load_onnx(path: str):
    """The user's ONNX model, at an IR version ONNX Runtime loads."""
    import onnx

    file = Path(path)
    if not file.is_file():
        raise ModelError(f"model.path: ONNX file {file} does not exist")
    try:
        model = onnx.load(str(file), load_external_data=False)
    except Exception as error:  # protobuf raises its own DecodeError
        raise ModelError(f"model.path: {file} is not a readable ONNX model ({error})") from None
    check_external_data(model, file)
    onnx.load_external_data_for_model(model, str(file.parent))
    if model.ir_version > MAX_IR_VERSION:
        downgrade_ir(model, str(file))
    return model


def check_external_data(model, file: Path) -> None:
    """Initializers stored as external data are read only from regular files in
    the model's own folder, after resolving symlinks: onnx refuses `../` and
    absolute locations but follows a symlink, which would copy whatever it points
    at (/etc/passwd, a private key) into the trained and exported model."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    folder = file.parent.resolve()
    for tensor in _get_all_tensors(model):  # what onnx.load_external_data_for_model reads
        if not uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (folder / location).resolve()
        if not location or not target.is_relative_to(folder) or not target.is_file():
            what = "a file outside the model's folder" if location and not target.is_relative_to(folder) else \
                "not a regular file"
            raise ModelError(
                f"model.path: {file}: initializer {tensor.name!r} has its data in {location!r}, which is {what} "
                f"({target}); external data must be a regular file in {folder}"
            )


def downgrade_ir(model, where: str) -> None:
    """Rewrite the IR version to 10 when nothing in the model needs a newer one
    (newer writers stamp IR 11 on models that only use older features); else
    say what needs it."""
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    elem_types = {t.data_type for t in model.graph.initializer} | {
        v.type.tensor_type.elem_type
        for v in [*model.graph.input, *model.graph.output, *model.graph.value_info]
        if v.type.HasField("tensor_type")
    }
    newer_types = sorted(t for t in elem_types if t > MAX_ELEM_TYPE_FOR_IR)
    if opset > MAX_OPSET_FOR_IR or newer_types:
        needs = f"ONNX opset {opset}" if opset > MAX_OPSET_FOR_IR else f"tensor element type(s) {newer_types}"
        raise ModelError(
            f"model.path: {where} has IR version {model.ir_version} and uses {needs}, which IR version "
            f"{MAX_IR_VERSION} (the newest that onnxruntime-training 1.19 loads) cannot express; re-export it "
            f"with opset <= {MAX_OPSET_FOR_IR} and IR version {MAX_IR_VERSION} (e.g. with onnx==1.17, "
            f"torch.onnx.export(..., opset_version=16))"
        )
    log.warning(
        "%s: IR version %d lowered to %d (opset %d needs nothing newer); onnxruntime-training 1.19 loads IR <= %d",
        where,
        model.ir_version,
        MAX_IR_VERSION,
        opset,
        MAX_IR_VERSION,
    )
    model.ir_version = MAX_IR_VERSION


def import_torch(path: str, kwargs: dict):
    """Construct `package.module:Class(**kwargs)`. Importing the module runs its
    code, like any import; nothing else is called before `Class` is known to be
    a subclass of torch.nn.Module (`os:system` is refused without being called).
    The module is looked up where Python looks (PYTHONPATH, installed packages),
    then in the working directory, which goes last: a `json.py` or `torch.py`
    there cannot replace the real one."""
    import torch

    module_name, _, class_name = path.partition(":")
    dotted = module_name.split(".")
    if not all(part.isidentifier() for part in dotted) or not class_name.isidentifier():
        raise ModelError(f"model.path: {path!r} is not an import path of the form `package.module:Class`")
    if str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelError(f"model.path: cannot import module {module_name!r} ({error})") from None
    cls = getattr(module, class_name, None)
    where = f"module {module_name!r} ({getattr(module, '__file__', None) or 'built in'})"
    if cls is None:
        raise ModelError(f"model.path: {where} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ModelError(
            f"model.path: {path} is {_kind_of(cls)}, not a subclass of torch.nn.Module; "
            "name a torch.nn.Module class"
        )
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ModelError(f"model.kwargs: {path}(**{kwargs!r}) failed: {error}") from None


def _kind_of(value) -> str:
    return f"the class {value.__qualname__}" if isinstance(value, type) else f"a {type(value).__name__}"
