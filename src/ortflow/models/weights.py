"""`model.weights`: pretrained weights loaded into the model before build_artifacts
builds its graphs, so that the initial checkpoint holds them bit for bit.

The weights come from a `.safetensors` file (the `safetensors` library: a JSON
header and raw arrays, checked against the file's size before anything is read)
or from an ortflow run's merged checkpoint folder (`results/<run>/checkpoint`,
its ONNX Runtime `checkpoint` file, read by checkpoints/ort_format without ORT).
Pickle files (torch.save's `.bin`, `.pt`, `.pth`, `.ckpt`) are refused: loading
one runs whatever code it holds.

The names are the model's own: a torch module's state_dict names (which the
ONNX initializers are named after: build_artifacts exports without renaming),
an ONNX file's initializer names. They are matched strictly: every float tensor
of the model must be in the weights and every tensor of the weights in the
model, with its shape, unless `model.weights_skip` names it; the model's skipped
tensors keep their initial values (drawn from run.seed), the weights' are ignored.

Names that differ only by a prefix (a wrapper's `model.`, a base model's
`transformer.`) are the one mismatch that users meet most, loading a folder's own
`model.safetensors` into a module that holds the model as an attribute: the prefix
is added to or removed from the weights' names, as `model.weights_prefix` says or,
without it, when one prefix alone makes every name fit (matching by suffix).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..user_files import CHECKPOINT, weights_files
from .patterns import matches

log = logging.getLogger("ortflow.build_artifacts")

# torch.save's files are pickles, whatever their suffix says.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CONVERSION = ("python -c \"import torch, safetensors.torch as st; st.save_file({{k: v.contiguous().clone() for k, v in "
              "torch.load('{path}', weights_only=True).items()}}, '{stem}.safetensors')\"")
SHOWN = 5  # names shown per kind of mismatch
ADDED, REMOVED = "added to", "removed from"  # what a prefix does to the weights' names


@dataclass(frozen=True)
class Request:
    """What the config asks of the weights: `model.weights` and the keys about it."""
    path: str
    skip: tuple[str, ...]
    prefix: str | None


def requested(model) -> Request | None:
    """The config's `model.weights*` keys (None without model.weights): the one place they are read."""
    if not model.weights:
        return None
    return Request(model.weights, tuple(model.weights_skip), model.weights_prefix)


def read(path: str) -> dict[str, np.ndarray]:
    """The named arrays of `model.weights`: a .safetensors file or a merged checkpoint folder."""
    file = Path(path)
    if file.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelError(
            f"model.weights: {file} is a pickle file (torch.save), and loading one could run code; convert it "
            f"once, where you trust it, to safetensors: {CONVERSION.format(path=file, stem=file.with_suffix(''))}"
        )
    weights_files(path)  # neither it nor the files read from it are links or special files
    if file.is_dir():
        return read_checkpoint_folder(file)
    if not file.is_file():
        raise ModelError(f"model.weights: {file} does not exist (a .safetensors file, or a run's "
                         "results/<run>/checkpoint folder)")
    if file.suffix.lower() != ".safetensors":
        raise ModelError(f"model.weights: {file} is neither a .safetensors file nor a merged checkpoint folder "
                         "(results/<run>/checkpoint)")
    return read_safetensors(file)


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file. The library reads the header first and
    refuses one that is too large (over 100 MB) or that does not cover the file
    exactly, before it allocates anything. numpy has no bfloat16: such tensors are
    read through torch and widened to float32, which keeps every value exactly."""
    from safetensors import SafetensorError, safe_open

    try:
        arrays = {}
        with safe_open(str(file), framework="numpy") as numpy_file:
            names = list(numpy_file.keys())
            bfloat16 = [name for name in names if numpy_file.get_slice(name).get_dtype() == "BF16"]
            for name in names:
                if name not in bfloat16:
                    arrays[name] = numpy_file.get_tensor(name)
        if bfloat16:
            with safe_open(str(file), framework="pt") as torch_file:
                for name in bfloat16:
                    arrays[name] = torch_file.get_tensor(name).float().numpy()
        return {name: arrays[name] for name in names}
    except (SafetensorError, OSError, ValueError, TypeError) as error:
        raise ModelError(f"model.weights: {file} is not a readable safetensors file ({error})") from None


def read_checkpoint_folder(folder: Path) -> dict[str, np.ndarray]:
    """The parameters (trained and frozen, BatchNorm's running statistics among
    them) of an ortflow run's merged checkpoint."""
    from ..checkpoints.ort_format import CheckpointError, read_ort_checkpoint

    file = folder / CHECKPOINT
    if not file.is_file():
        raise ModelError(
            f"model.weights: {folder} is a folder without a merged checkpoint file {CHECKPOINT!r}; name an ortflow "
            "run's results/<run>/checkpoint, or a .safetensors file (in a transformers folder: model.safetensors)"
        )
    try:
        # Copy-on-write: plan hands the arrays on as they are, and a module may write its tensors.
        return dict(read_ort_checkpoint(file, writable=True).parameters)
    except CheckpointError as error:  # names the file
        raise ModelError(f"model.weights: {error}") from None
    except Exception as error:  # a damaged flatbuffer fails anywhere in the generated reader
        raise ModelError(f"model.weights: {file} is not a readable ONNX Runtime checkpoint ({error})") from None


def plan(request: Request, weights: dict[str, np.ndarray], model: dict[str, tuple[tuple, np.dtype]],
         required: list[list[str]]) -> dict[str, np.ndarray]:
    """The arrays to load, by model name, in the model's dtype (the weights' own arrays where they
    have it, not copies). `model`: name ->
    (shape, dtype) of every tensor the weights may set; `required`: the tensors the
    weights must set, each by its names (a tensor shared under several names, such as
    a tied embedding, is set under any one of them). Missing, unexpected and mismatched
    names (another shape, or a dtype that does not widen exactly into the model's) are
    refused together, in one line."""
    source, skip = request.path, request.skip

    def skipped(name: str, patterns: list[str] = skip) -> bool:
        # Name patterns only (the schema allows no rules such as <1d> here), so no dimensions or embeddings.
        return matches(name, 0, set(), patterns)

    weights, renaming = _prefixed(request, weights, model, required, skipped)
    for pattern in skip:
        if not any(skipped(name, [pattern]) for name in [*model, *weights]):
            raise ModelError(f"model.weights_skip: {pattern!r} matches no name of the model or of {source}")

    missing, unexpected = _unfit(weights, model, required, skipped)
    mismatched: dict[str, str] = {}  # name -> both shapes and dtypes
    loaded = {}
    for name, array in weights.items():
        if name not in model or skipped(name):
            continue
        shape, dtype = model[name]
        if tuple(array.shape) != tuple(shape) or not np.can_cast(array.dtype, dtype, casting="safe") \
                or array.dtype.kind != np.dtype(dtype).kind:
            mismatched[name] = f"{name} (weights {array.dtype} {list(array.shape)}, model {np.dtype(dtype)} " \
                               f"{list(shape)})"
        else:
            # The array itself where it has the model's dtype: a copy would hold the weights a second
            # time while a checkpoint's mapped file is read (1 W at export_model's build of the gpt).
            loaded[name] = array if array.dtype == dtype else array.astype(dtype)
    if missing or unexpected or mismatched:
        kinds = (("missing", missing), ("unexpected", unexpected), ("mismatched", list(mismatched.values())))
        raise ModelError(f"model.weights: {source} does not fit the model: {_renaming_said(request, renaming)}"
                         + "; ".join(_listed(what, names) for what, names in kinds if names)
                         + f"; leave names out with model.weights_skip (name patterns, e.g. "
                           f"{_skip_example(missing + unexpected + list(mismatched))}): "
                           "the model's then keep their initial values from run.seed")
    if renaming:
        prefix, how = renaming
        log.info("model.weights: the prefix %r %s the names of %s, %s", prefix, how, source,
                 "as model.weights_prefix says" if request.prefix else
                 "the one prefix that makes them the model's (matched by suffix; model.weights_prefix sets it)")
    return loaded


def _unfit(weights: dict, model: dict, required: list[list[str]], skipped) -> tuple[list[str], list[str]]:
    """The model's tensors that the weights do not set (missing), and the weights' names
    that are not the model's (unexpected), leaving out what model.weights_skip names."""
    unexpected = [name for name in weights if name not in model and not skipped(name)]
    missing = [names[0] for names in required if not any(name in weights or skipped(name) for name in names)]
    return missing, unexpected


def _renamed(weights: dict, prefix: str, how: str) -> dict | None:
    """The weights with `prefix` added to every name, or removed from every name that
    starts with it; None where two names would become one."""
    names = {(prefix + name if how == ADDED else name.removeprefix(prefix)): name for name in weights}
    return {new: weights[old] for new, old in names.items()} if len(names) == len(weights) else None


def _prefixes(weights: dict, model: dict) -> list[tuple[str, str]]:
    """The (prefix, how) that make at least one name of the weights a name of the
    model: a name of one side that is a dotted prefix followed by a name of the other."""
    found: dict[tuple[str, str], None] = {}  # an ordered set
    for names, others, how in ((model, weights, ADDED), (weights, model, REMOVED)):
        for name in names:
            parts = name.split(".")
            for cut in range(1, len(parts)):
                if ".".join(parts[cut:]) in others:
                    found[(".".join(parts[:cut]) + ".", how)] = None
    return list(found)


def _prefixed(request: Request, weights: dict, model: dict, required: list[list[str]], skipped):
    """The weights under the model's names, and the (prefix, how) that renamed them
    (None: as they are). model.weights_prefix is added or removed, whichever makes more
    of the weights' names the model's. Without it, names that do not fit as they are
    are matched by suffix: a prefix that makes every name fit is applied when it is
    the only one; one that leaves at most half as many names unfit is applied too, so
    that the refusal (which follows) names it and lists what is left, not every name."""
    if request.prefix:
        hits = {}
        for how in (ADDED, REMOVED):
            renamed = _renamed(weights, request.prefix, how)
            if renamed is not None:
                hits[how] = (sum(new in model and new not in weights for new in renamed), renamed)
        how = max(hits, key=lambda key: hits[key][0], default=None)
        if how is None or hits[how][0] == 0:
            raise ModelError(f"model.weights_prefix: {request.prefix!r}, added to or removed from the names of "
                             f"{request.path}, makes none of them a name of the model")
        return hits[how][1], (request.prefix, how)
    unfit = sum(map(len, _unfit(weights, model, required, skipped)))
    if not unfit:
        return weights, None
    scored = []
    for prefix, how in _prefixes(weights, model):
        renamed = _renamed(weights, prefix, how)
        if renamed is not None:
            scored.append((sum(map(len, _unfit(renamed, model, required, skipped))), prefix, how, renamed))
    fewest = min((score for score, *_ in scored), default=unfit)
    best = [(prefix, how, renamed) for score, prefix, how, renamed in scored if score == fewest]
    if fewest * 2 > unfit or (fewest and len(best) > 1):
        return weights, None
    if len(best) > 1:
        raise ModelError(f"model.weights: the names of {request.path} fit the model's with any of "
                         + ", ".join(f"{prefix!r} {how} them" for prefix, how, _ in best)
                         + "; set model.weights_prefix to the one that is meant")
    prefix, how, renamed = best[0]
    return renamed, (prefix, how)


def _renaming_said(request: Request, renaming: tuple[str, str] | None) -> str:
    """The start of a refusal whose names were taken with a prefix: which, and how to set it."""
    if not renaming:
        return ""
    prefix, how = renaming
    if request.prefix:
        return f"with model.weights_prefix {prefix!r} {how} its names, "
    differ = "lack the model's prefix" if how == ADDED else "carry a prefix the model's lack,"
    return (f"its names {differ} {prefix!r} (set model.weights_prefix: {prefix!r}, or leave the prefix to matching "
            f"by suffix once the rest fits); with it {how.split()[0]}, ")


def _listed(what: str, names: list[str]) -> str:
    more = f", ... ({len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return f"{len(names)} {what}: {', '.join(names[:SHOWN])}{more}"


def _skip_example(names: list[str]) -> list[str]:
    """The modules that hold the mismatched names (`model.classifier` for
    `model.classifier.weight`), when they are few; else a generic example."""
    modules = list(dict.fromkeys(name.rpartition(".")[0] or name for name in names))
    return modules if len(modules) <= 3 else ["head"]


def _report(source: str, loaded: dict, kept: list[str]) -> None:
    log.info("model.weights: %d tensor(s) (%d values) loaded from %s%s", len(loaded),
             sum(array.size for array in loaded.values()), source,
             f"; {_listed('keep their initial values (model.weights_skip)', kept)}" if kept else "")


def load_into_module(module, request: Request, keep_absent: bool = False) -> list[str]:
    """Set a torch module's parameters and buffers (its state_dict) from the weights,
    before it is exported. Integer buffers (BatchNorm's num_batches_tracked) are
    loaded when the weights have them and not required: ortflow keeps no such tensor.
    With `keep_absent` (export_model, from a run's merged checkpoint, which has no tensor
    that forward never reads: torch.onnx leaves those out) a float tensor the weights
    lack keeps its value too. Returns the float tensors that kept their values."""
    import torch

    tensors = module.state_dict(keep_vars=True)  # the live tensors; a tied one under each of its names
    names_of: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        names_of.setdefault(id(tensor), []).append(name)
    model = {name: (tuple(tensor.shape), torch.empty(0, dtype=tensor.dtype).numpy().dtype)
             for name, tensor in tensors.items()}
    path = request.path
    given = read(path)
    required = [names for names in names_of.values() if tensors[names[0]].is_floating_point()
                and (not keep_absent or any(name in given for name in names))]
    loaded = plan(request, given, model, required)
    for names in names_of.values():
        given = [name for name in names if name in loaded]
        if any(not np.array_equal(loaded[given[0]], loaded[name]) for name in given[1:]):
            raise ModelError(f"model.weights: {path} gives {', '.join(given)} different values, but they are one "
                             "tensor of the model (tied); leave all but one out with model.weights_skip")
    with torch.no_grad():
        for names in names_of.values():
            given = [name for name in names if name in loaded]
            if given and tensors[names[0]].is_meta:
                _assign(module, names, tensors[names[0]], torch.from_numpy(loaded[given[0]]))
            elif given:
                tensors[names[0]].copy_(torch.from_numpy(loaded[given[0]]))
    set_tensors = {id(tensors[name]) for name in loaded}
    kept = [names[0] for key, names in names_of.items()
            if key not in set_tensors and tensors[names[0]].is_floating_point()]
    if any(tensors[names[0]].is_meta for key, names in names_of.items() if key not in set_tensors):
        raise ModelError(f"model.weights: {path} leaves {', '.join(kept[:5])} of a model built without values "
                         "(on the meta device) unset; build it with its values")
    _report(path, loaded, kept)
    return kept


def _assign(module, names: list[str], placeholder, tensor) -> None:
    """`tensor` (the loaded array's own memory) as the module's tensor under each of its `names`
    (tied: one tensor under several), in place of the meta device's `placeholder`: no copy."""
    import torch

    if isinstance(placeholder, torch.nn.Parameter):
        tensor = torch.nn.Parameter(tensor, requires_grad=placeholder.requires_grad)
    for name in names:
        owner, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(owner), attribute, tensor)


def load_into_onnx(model, request: Request) -> None:
    """Set an ONNX model's initializers from the weights, by name."""
    from onnx import helper, numpy_helper

    initializers = {t.name: t for t in model.graph.initializer}
    shapes = {name: (tuple(t.dims), helper.tensor_dtype_to_np_dtype(t.data_type)) for name, t in initializers.items()}
    floats = [name for name, (_, dtype) in shapes.items() if np.dtype(dtype).kind == "f"]
    loaded = plan(request, read(request.path), shapes, [[name] for name in floats])
    for name, array in loaded.items():
        initializers[name].CopyFrom(numpy_helper.from_array(array, name))
    _report(request.path, loaded, [name for name in initializers if name in floats and name not in loaded])
