"""ONNX Runtime's checkpoint file, read and written as arrays.

ORT's Python API saves and loads a checkpoint only as a file (a flatbuffer whose
schema ships in the wheel under onnxruntime/tools/ort_format_model) and exposes
the optimizer state (AdamW: momentum0, momentum1) only through it. This module
turns such a file into a `TrainingState` of numpy arrays and back, byte for
byte what ORT itself reads, so that state split into shards and joined again
resumes bit-identically.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import atomic, storage
from ..errors import CheckpointError
from ..external_data import data_file, threshold
from ..ort_private import checkpoint_schema

ORT_IDENTIFIER = b"ODTC"  # the file identifier of ONNX Runtime's checkpoint flatbuffer


@dataclass
class TrainingState:
    """Everything in an ONNX Runtime checkpoint with optimizer state, as arrays."""

    parameters: dict[str, np.ndarray]
    requires_grad: dict[str, bool]
    optimizer_states: dict[str, dict[str, np.ndarray]]  # parameter -> {momentum0: array, ...}
    optimizer: dict  # group_name, step, initial_learning_rate
    properties: dict  # name -> int, float or str
    version: int = 2
    # Set in a shard's part: name -> (full shape, first element) of each array, which is then a flat slice.
    slices: dict[str, tuple[tuple[int, ...], int]] | None = None

    def part(self, ranges: dict[str, tuple[int, int]]) -> TrainingState:
        """Elements [start, stop) of the flattened parameters named in `ranges`, and of their optimizer state."""
        def cut(array: np.ndarray, name: str) -> np.ndarray:
            return array.reshape(-1)[slice(*ranges[name])]

        return TrainingState(
            {n: cut(self.parameters[n], n) for n in ranges}, {n: self.requires_grad[n] for n in ranges},
            {n: {m: cut(a, n) for m, a in self.optimizer_states[n].items()} for n in ranges
             if n in self.optimizer_states},
            self.optimizer, self.properties, self.version,
            {n: (self.parameters[n].shape, ranges[n][0]) for n in ranges},
        )

    def nbytes(self, name: str) -> int:
        return self.parameters[name].nbytes + sum(a.nbytes for a in self.optimizer_states.get(name, {}).values())

    def total_bytes(self) -> int:
        """The bytes of every array: the parameters and their optimizer state."""
        return sum(self.nbytes(name) for name in self.parameters)



def _np_dtype(onnx_type: int) -> np.dtype:
    from onnx.helper import tensor_dtype_to_np_dtype

    return np.dtype(tensor_dtype_to_np_dtype(onnx_type))


def read_ort_checkpoint(path: Path, writable: bool = False) -> TrainingState:
    """Parse an ONNX Runtime checkpoint file (and its `<checkpoint>.data`, if it has one).
    The arrays are read-only views of the files mapped into memory (no copy; they stay
    valid after the files are deleted). `writable`: mapped copy-on-write instead, so that
    a torch module can take the arrays as its tensors (models/weights.py): a write gets a
    private copy of its page and never reaches the files."""
    Fbs = checkpoint_schema("Checkpoint").Checkpoint

    access = mmap.ACCESS_COPY if writable else mmap.ACCESS_READ
    buf = _mapped(path, access=access)
    if not Fbs.CheckpointBufferHasIdentifier(buf, 0):
        raise CheckpointError(f"{path}: not an ONNX Runtime checkpoint (no {ORT_IDENTIFIER.decode()} identifier)")
    root = Fbs.GetRootAs(buf, 0)
    module = root.ModuleState()
    external = _external_data(path, access) if module.HasExternalData() else None

    def array(tensor) -> np.ndarray:
        dims = [int(d) for d in tensor.DimsAsNumpy()] if not tensor.DimsIsNone() else []
        dtype = _np_dtype(tensor.DataType())
        offset = tensor.ExternalDataOffset()
        if offset < 0:
            raw = tensor.RawDataAsNumpy() if not tensor.RawDataIsNone() else np.zeros(0, np.uint8)
            return raw.view(dtype).reshape(dims)
        count = int(np.prod(dims, dtype=np.int64))
        if external is None or offset + count * dtype.itemsize > len(external):
            raise CheckpointError(f"{path}: tensor {tensor.Name().decode()!r} lies at bytes {offset}.."
                                  f"{offset + count * dtype.itemsize} of {data_file(path)}, which "
                                  f"{'has ' + str(len(external)) + ' bytes' if external is not None else 'is not there'}"
                                  "; the checkpoint and its data file do not belong together")
        return np.frombuffer(external, dtype, count, offset).reshape(dims)

    parameters, requires_grad = {}, {}
    for count, get, trainable in ((module.RequiresGradParamsLength(), module.RequiresGradParams, True),
                                  (module.FrozenParamsLength(), module.FrozenParams, False)):
        for i in range(count):
            tensor = get(i)
            name = tensor.Name().decode()
            parameters[name], requires_grad[name] = array(tensor), trainable
    if root.OptimizerGroupsLength() > 1:
        raise CheckpointError(f"{path}: {root.OptimizerGroupsLength()} optimizer groups; ortflow expects one")
    optimizer, optimizer_states = {}, {}
    if root.OptimizerGroupsLength() == 1:
        group = root.OptimizerGroups(0)
        optimizer = {"group_name": group.GroupName().decode(), "step": int(group.Step()),
                     "initial_learning_rate": float(group.InitialLearningRate())}
        for i in range(group.OptimizerStatesLength()):
            entry = group.OptimizerStates(i)
            optimizer_states[entry.ParamName().decode()] = {
                entry.Momentums(j).Name().decode(): array(entry.Momentums(j)) for j in range(entry.MomentumsLength())
            }
    properties: dict = {}
    bag = root.PropertyBag()
    if bag is not None:
        for count, get, kind in ((bag.IntsLength(), bag.Ints, int), (bag.FloatsLength(), bag.Floats, float),
                                 (bag.StringsLength(), bag.Strings, bytes.decode)):
            for i in range(count):
                prop = get(i)
                properties[prop.Name().decode()] = kind(prop.Value())
    return TrainingState(parameters, requires_grad, optimizer_states, optimizer, properties, root.Version())


def _mapped(path: Path, what: str = "an ONNX Runtime checkpoint", access: int = mmap.ACCESS_READ) -> mmap.mmap:
    """The file `path` mapped into memory, read-only or (ACCESS_COPY) copy-on-write."""
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=access)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not there ({what})") from None


def _external_data(path: Path, access: int) -> mmap.mmap:
    """The checkpoint's `<checkpoint>.data`, mapped: a regular file beside it, not a link
    (which would read whatever it points at as weights)."""
    data = data_file(path)
    if data.is_symlink() or (data.exists() and not data.is_file()):
        raise CheckpointError(f"{data}: the external data of checkpoint {path} is a link or not a regular file; "
                              "it must be a regular file beside the checkpoint")
    return _mapped(data, "an ONNX Runtime checkpoint with external data", access)


def ort_checkpoint_bytes(state: TrainingState) -> bytearray:
    """The ONNX Runtime checkpoint file of `state` (what CheckpointState.load_checkpoint reads)
    with every tensor inside it, in memory (below 2 GiB)."""
    builder = _checkpoint(state, None)
    return builder.Output()


def write_ort_checkpoint(path: Path, state: TrainingState) -> bool:
    """Write `state` as the ONNX Runtime checkpoint `path`: its tensors inside the file,
    or in `<path>.data` when they total more than external_data.threshold() bytes (a data
    file of an earlier write is removed, never truncated: arrays read from it may still
    map it). The flatbuffer goes to disk from the builder's own buffer, and `path` is
    renamed into place last. Return whether the tensors went to the data file."""
    path = Path(path)
    data = data_file(path)
    data.unlink(missing_ok=True)
    external = state.total_bytes() > threshold()
    if external:
        try:
            with open(data, "wb") as f:
                builder = _checkpoint(state, _External(f))
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            raise storage.named(error, data)
    else:
        builder = _checkpoint(state, None)
    atomic.write_bytes(path, memoryview(builder.Bytes)[builder.Head():])
    return external


def apply_threshold(path: Path) -> None:
    """Rewrite ONNX Runtime's checkpoint `path` with its tensors in `<path>.data` if they total
    more than external_data.threshold() bytes but ORT, whose own threshold is higher, kept them
    inside."""
    if data_file(path).exists():
        return
    state = read_ort_checkpoint(path)
    if state.total_bytes() > threshold():
        write_ort_checkpoint(path, state)


class _External:
    """The writer of a checkpoint's external data file: each tensor's bytes at an offset
    aligned to its element size, as ORT writes them."""

    def __init__(self, f):
        self.f, self.offset = f, 0

    def write(self, array: np.ndarray) -> int:
        self.f.write(bytes(-self.offset % array.itemsize))
        self.offset += -self.offset % array.itemsize
        start = self.offset
        self.f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        self.offset += array.nbytes
        return start


def _checkpoint(state: TrainingState, external: _External | None):
    """The finished flatbuffer builder of `state`: the parameters, the optimizer state and
    the properties, built in that order; the tensors' bytes in `external`, if given."""
    import flatbuffers

    C = checkpoint_schema("Checkpoint")

    inside = 0 if external else state.total_bytes()
    builder = flatbuffers.Builder(inside + 4096 * (len(state.parameters) + 1))
    module = _module_state(builder, state, external)
    groups = _optimizer_groups(builder, state, external)
    bag = _property_bag(builder, state.properties)
    C.Start(builder)
    C.AddVersion(builder, state.version)
    C.AddModuleState(builder, module)
    C.AddOptimizerGroups(builder, groups)
    C.AddPropertyBag(builder, bag)
    builder.Finish(C.End(builder), file_identifier=ORT_IDENTIFIER)
    return builder


def _tensor(builder, name: str, array: np.ndarray, external: _External | None) -> int:
    from onnx.helper import np_dtype_to_tensor_dtype
    Tensor = checkpoint_schema("Tensor")

    name_offset = builder.CreateString(name)
    raw = None if external else builder.CreateNumpyVector(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    offset = external.write(array) if external else None
    dims = builder.CreateNumpyVector(np.asarray(array.shape, dtype=np.int64))
    Tensor.Start(builder)
    Tensor.AddName(builder, name_offset)
    Tensor.AddDims(builder, dims)
    Tensor.AddDataType(builder, np_dtype_to_tensor_dtype(array.dtype))
    if external:
        Tensor.AddExternalDataOffset(builder, offset)
    else:
        Tensor.AddRawData(builder, raw)
    return Tensor.End(builder)


def _vector(builder, start, offsets: list[int]) -> int:
    start(builder, len(offsets))
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


def _module_state(builder, state: TrainingState, external: _External | None) -> int:
    """The trainable and the frozen parameters."""
    ModuleState = checkpoint_schema("ModuleState")

    names = sorted(state.parameters)
    trainable = _vector(builder, ModuleState.StartRequiresGradParamsVector,
                        [_tensor(builder, n, state.parameters[n], external) for n in names if state.requires_grad[n]])
    frozen = _vector(builder, ModuleState.StartFrozenParamsVector,
                     [_tensor(builder, n, state.parameters[n], external) for n in names
                      if not state.requires_grad[n]])
    ModuleState.Start(builder)
    ModuleState.AddRequiresGradParams(builder, trainable)
    ModuleState.AddFrozenParams(builder, frozen)
    ModuleState.AddHasExternalData(builder, external is not None)
    return ModuleState.End(builder)


def _optimizer_groups(builder, state: TrainingState, external: _External | None) -> int:
    """The vector of optimizer groups: none, or one with every parameter's moments."""
    C, OptimizerGroup, ParameterOptimizerState = map(
        checkpoint_schema, ("Checkpoint", "OptimizerGroup", "ParameterOptimizerState"))

    groups = []
    if state.optimizer:
        entries = []
        for name in sorted(state.optimizer_states):
            moments = state.optimizer_states[name]
            moment_offsets = [_tensor(builder, m, moments[m], external) for m in sorted(moments)]
            param_name = builder.CreateString(name)
            moments_vector = _vector(builder, ParameterOptimizerState.StartMomentumsVector, moment_offsets)
            ParameterOptimizerState.Start(builder)
            ParameterOptimizerState.AddParamName(builder, param_name)
            ParameterOptimizerState.AddMomentums(builder, moments_vector)
            entries.append(ParameterOptimizerState.End(builder))
        entries_vector = _vector(builder, OptimizerGroup.StartOptimizerStatesVector, entries)
        group_name = builder.CreateString(state.optimizer["group_name"])
        OptimizerGroup.Start(builder)
        OptimizerGroup.AddGroupName(builder, group_name)
        OptimizerGroup.AddStep(builder, state.optimizer["step"])
        OptimizerGroup.AddInitialLearningRate(builder, state.optimizer["initial_learning_rate"])
        OptimizerGroup.AddOptimizerStates(builder, entries_vector)
        groups.append(OptimizerGroup.End(builder))
    return _vector(builder, C.StartOptimizerGroupsVector, groups)


def _property_bag(builder, properties: dict) -> int:
    """The properties, each in the table of its type (int, float or string)."""
    FloatProperty, IntProperty, PropertyBag, StringProperty = map(
        checkpoint_schema, ("FloatProperty", "IntProperty", "PropertyBag", "StringProperty"))

    props = {int: [], float: [], str: []}
    for name in sorted(properties):
        value = properties[name]
        kind = str if isinstance(value, str) else float if isinstance(value, float) else int
        table = {int: IntProperty, float: FloatProperty, str: StringProperty}[kind]
        name_offset = builder.CreateString(name)
        value = builder.CreateString(value) if kind is str else value
        table.Start(builder)
        table.AddName(builder, name_offset)
        table.AddValue(builder, value)
        props[kind].append(table.End(builder))
    ints = _vector(builder, PropertyBag.StartIntsVector, props[int])
    floats = _vector(builder, PropertyBag.StartFloatsVector, props[float])
    strings = _vector(builder, PropertyBag.StartStringsVector, props[str])
    PropertyBag.Start(builder)
    PropertyBag.AddInts(builder, ints)
    PropertyBag.AddFloats(builder, floats)
    PropertyBag.AddStrings(builder, strings)
    return PropertyBag.End(builder)


@contextmanager
def _scratch_file():
    """A file name in memory (/dev/shm) where there is one: ORT reads and writes only files."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, name = tempfile.mkstemp(prefix="ortflow-checkpoint-", dir=folder)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)
        data_file(Path(name)).unlink(missing_ok=True)


def ort_state(state: TrainingState):
    """A live CheckpointState holding `state` (parameters, optimizer state, properties)."""
    from onnxruntime.training.api import CheckpointState

    with _scratch_file() as scratch:
        write_ort_checkpoint(scratch, state)
        return CheckpointState.load_checkpoint(str(scratch))


def training_state(ort_checkpoint_state) -> TrainingState:
    """The arrays of a live CheckpointState (ORT writes them out; only its file format has the optimizer state)."""
    from onnxruntime.training.api import CheckpointState

    with _scratch_file() as scratch:
        CheckpointState.save_checkpoint(ort_checkpoint_state, str(scratch), include_optimizer_state=True)
        return read_ort_checkpoint(scratch)
