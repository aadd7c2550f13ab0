"""Weights beside the graph: ONNX models whose initializers are too large for one file.

Protobuf, which an ONNX model is, cannot hold more than 2 GiB, so a larger model
keeps its initializers in a second file beside it: ONNX's external data, one file
`<model>.onnx.data` for every initializer of 1 KiB or more, each tensor naming it
(`location`) with its offset and length. ONNX Runtime's checkpoint file has the
same limit and the same remedy, `<checkpoint>.data` (checkpoints/ort_format.py).

ortflow writes a model or a checkpoint that way when its tensors total more than
`threshold()` bytes: 1 GiB, well below the 2 GiB limit so that the graph and a
checkpoint's optimizer state fit beside the weights. The environment variable
ORTFLOW_EXTERNAL_DATA_BYTES sets another threshold; the tests set it to 0 to drive
a small model through the external-data path of every stage.

What ortflow reads as external data it reads only from regular files in the model's
own folder, within their size (`check`): onnx would follow a symlink anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError, ModelError

VARIABLE = "ORTFLOW_EXTERNAL_DATA_BYTES"
DEFAULT_THRESHOLD = 1 << 30
SUFFIX = ".data"  # ONNX Runtime's name for a checkpoint's, and ortflow's for a model's: `<file>.data`
# Initializers smaller than this stay in the graph (onnx's own default): shapes and scalars that
# shape inference reads.
INLINE_BYTES = 1024


def threshold() -> int:
    """Tensors totalling more bytes than this go to an external data file."""
    value = os.environ.get(VARIABLE, "")
    if not value:
        return DEFAULT_THRESHOLD
    if not value.isdecimal():
        raise ConfigError(f"environment variable {VARIABLE}={value!r}: must be a whole number of bytes "
                          f"(default {DEFAULT_THRESHOLD}; 0 puts every tensor in external data)")
    return int(value)


def data_file(path: Path) -> Path:
    """The external data file of the model or checkpoint `path`."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def initializer_bytes(model) -> int:
    """The bytes the model's initializers take (each below 2 GiB, so protobuf can size it)."""
    return sum(tensor.ByteSize() for tensor in model.graph.initializer)


def save_model(model, path: Path, name: Path | None = None) -> bool:
    """Write `model` to `path`, with its initializers in `data_file(name)` beside it when they
    total more than `threshold()` bytes (`name`: the model's final name, when `path` is a
    temporary one that is renamed to it later). Return whether it went to external data.
    Saving that way moves the initializers' bytes out of `model` (onnx clears them): a
    caller that still needs them loads the file again."""
    import onnx

    path = Path(path)
    data = path.with_name(data_file(name or path).name)  # onnx writes it beside the model
    # onnx appends to an existing data file: one from an earlier run would stay in front.
    data.unlink(missing_ok=True)
    if initializer_bytes(model) <= threshold():
        onnx.save(model, str(path))
        return False
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
              size_threshold=INLINE_BYTES)
    return True


def save_and_reload(model, path: Path):
    """save_model, then what to keep of `model`: itself, or where its weights went to external
    data, its graph read again from `path` without them. onnx clears the bytes it writes out,
    but protobuf keeps a message's memory until the message is freed: the build of a 554M GPT
    held 1.8 GB more to its end."""
    import onnx

    if not save_model(model, path):
        return model
    return onnx.load(str(path), load_external_data=False)


def save_graph(model, source: Path, path: Path, name: Path | None = None) -> None:
    """Write `model`, read from `source` (loaded with load_data=False) and changed in its
    graph alone, to `path`: its weights stay in the external data file they are in, renamed
    to `data_file(name or path)` beside `path` with every tensor pointed at it, so that they
    are never read into memory. A model without external data is saved as save_model does."""
    import onnx

    if not uses_external_data(model):
        save_model(model, path, name)
        return
    path = Path(path)
    data = path.with_name(data_file(name or path).name)
    locations = {entry.value for tensor in model.graph.initializer for entry in tensor.external_data
                 if entry.key == "location"}
    if len(locations) != 1:  # ortflow's and ONNX Runtime's writers put every tensor in one file
        raise ModelError(f"{source}: its initializers are in {len(locations)} external data files "
                         f"({sorted(locations)}); expected one")
    (Path(source).parent / locations.pop()).replace(data)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = data.name
    onnx.save(model, str(path))


def uses_external_data(model) -> bool:
    from onnx.external_data_helper import uses_external_data as uses

    return any(uses(tensor) for tensor in model.graph.initializer)


def load_model(path: Path, where: str = "", load_data: bool = True):
    """An ONNX model of ortflow's (artifacts, export) with its external data, if any, checked
    (`check`) before it is read; `load_data=False` leaves the weights in their file, for
    what reads the graph alone."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    check(model, path, where or str(path))
    if load_data and uses_external_data(model):
        onnx.load_external_data_for_model(model, str(path.parent))
    return model


def check(model, file: Path, where: str) -> None:
    """Initializers stored as external data are read only from regular files in
    the model's own folder, after resolving symlinks: onnx refuses `../` and
    absolute locations but follows a symlink, which would copy whatever it points
    at (/etc/passwd, a private key) into the trained and exported model. Their
    offset and length must lie within the file: onnx reads `length` bytes at
    once, so a length of 2^40 on a small file is a MemoryError, not an error.
    `where` starts the error's line (the config key or file the model came from)."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data as uses

    folder = Path(file).parent.resolve()
    for tensor in _get_all_tensors(model):  # what onnx.load_external_data_for_model reads
        if not uses(tensor):
            continue
        # The last entry of a key counts, as in onnx's ExternalDataInfo.
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        target = (folder / location).resolve()
        said = f"{where}: initializer {tensor.name!r} has its data in {location!r}"
        if not location or not target.is_relative_to(folder) or not target.is_file():
            what = "a file outside the model's folder" if location and not target.is_relative_to(folder) else \
                "not a regular file"
            raise ModelError(f"{said}, which is {what} ({target}); external data must be a regular file in {folder}")
        offset, length = (info.get(key) or "0" for key in ("offset", "length"))  # onnx: empty is absent
        if not (offset.isdecimal() and length.isdecimal()):  # digits only: no sign, no space
            raise ModelError(f"{said} at offset {offset!r}, length {length!r}; both must be whole numbers of bytes")
        size, start, count = target.stat().st_size, int(offset), int(length)
        # Without a length (or with 0), onnx reads from the offset to the end of the file.
        if start > size or start + count > size:
            read = f"{count} bytes" if count else "the rest of the file"
            raise ModelError(f"{said}: {read} from offset {start}, beyond the end "
                             f"of the file ({size} bytes): the model does not match its data file; save the two "
                             "again together (onnx.save_model with save_as_external_data=True)")


def weights_as_inputs(model, path: Path) -> dict:
    """The initializers of `model` (read from `path` with load_data=False, `check`ed) that are in
    external data, each read from the data file into its array and made a graph input: name ->
    array. For ONNX's reference evaluator, which given the weights in the model holds them twice
    (the model's bytes and its arrays)."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data as uses

    arrays, kept = {}, []
    for tensor in model.graph.initializer:
        if not uses(tensor):
            kept.append(tensor)
            continue
        # A copy of the tensor reads the bytes: to_array leaves them in the tensor it reads, which
        # would keep the weights a second time in `model` (protobuf frees them with the message).
        alone = onnx.TensorProto()
        alone.CopyFrom(tensor)
        arrays[tensor.name] = numpy_helper.to_array(alone, str(Path(path).parent))
        del alone
        model.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return arrays


def model_bytes(path: Path) -> int:
    """The size of the model `path` with its external data file, if it has one."""
    data = data_file(path)
    return Path(path).stat().st_size + (data.stat().st_size if data.is_file() else 0)


def replace(source: Path, path: Path) -> None:
    """Rename the finished model `source`, saved for `path` (save_model's `name`), to `path`:
    its external data file first, so that the model, once in place, finds its data; or,
    without one, the data file of an earlier model at `path` removed."""
    from . import atomic

    data = Path(source).with_name(data_file(path).name)
    if data.is_file():
        atomic.replace(data, data_file(path))
    else:
        data_file(path).unlink(missing_ok=True)
    atomic.replace(source, path)
