"""Bring your own model: `model.kind: onnx` (a file) or `torch` (an import path).

An ONNX file as the model zoo ships it is adapted on loading (`load_onnx`): an
IR version above 10 lowered, an opset below 12 (14 with BatchNormalization)
converted, an IR version below what its opsets need (below 4: initializers
listed as inputs) raised and the initializers made initializers only, a fixed
batch dimension made dynamic, BatchNormalization switched to training mode.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

from .. import external_data
from ..errors import ModelError
from ..onnx_nodes import reads
from . import batchnorm, is_float

log = logging.getLogger("ortflow.build_artifacts")

# onnxruntime-training 1.19 loads models up to IR version 10, which goes with
# ONNX opsets up to 22 and tensor types up to INT4 (22).
MAX_IR_VERSION = 10
MAX_OPSET_FOR_IR = 22
MAX_ELEM_TYPE_FOR_IR = 22
# The cross-entropy loss is SoftmaxCrossEntropyLoss, an operator since opset 12:
# older models are converted to the opset that ortflow exports torch modules at.
MIN_OPSET = 12
CONVERTED_OPSET = 16
# The domain of classical machine-learning operators (trees, linear models, ZipMap), without gradients.
ML_DOMAIN = "ai.onnx.ml"
# Before IR version 4 every initializer had to be listed as a graph input too.
IR_WITHOUT_INITIALIZER_INPUTS = 4
BATCH = "batch"


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
    check_trainable(model, str(file))
    external_data.check(model, file, f"model.path: {file}")
    onnx.load_external_data_for_model(model, str(file.parent))
    if model.ir_version > MAX_IR_VERSION:
        downgrade_ir(model, str(file))
    model = upgrade_opset(model, str(file))
    upgrade_ir(model, str(file))
    drop_initializer_inputs(model, str(file))
    drop_unused_initializers(model, str(file))
    sums_to_adds(model, str(file))
    dynamic_batch(model, str(file))
    batchnorm.to_training_mode(model, str(file))
    return model


def check_trainable(model, where: str) -> None:
    """Refuse, before converting anything, a model that ONNX Runtime cannot train:
    one with operators of the `ai.onnx.ml` domain (trees, linear classifiers,
    ZipMap: what scikit-learn models become in ONNX), which have no gradients, or
    one without float initializers, which has no weights to train."""
    ml = sorted({node.op_type for node in model.graph.node if node.domain == ML_DOMAIN})
    if ml:
        raise ModelError(
            f"model.path: {where} has operators of the {ML_DOMAIN} domain ({', '.join(ml)}), as scikit-learn models "
            "converted to ONNX have; ONNX Runtime has no gradients for them, so ortflow cannot train it (it trains "
            "networks of standard ONNX operators whose weights are float initializers): fit it in scikit-learn, or "
            "train a network instead (model.kind: mlp, or your own with model.kind: torch)"
        )
    if not any(is_float(t) for t in model.graph.initializer):
        raise ModelError(
            f"model.path: {where} has no float initializer, so nothing to train (its weights, if any, are held in "
            "Constant nodes or node attributes); export the model with its weights as initializers (torch.onnx.export"
            "(..., do_constant_folding=False) keeps parameters as initializers), or use model.kind: torch"
        )


def default_opset(model) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def upgrade_opset(model, where: str):
    """A model older than MIN_OPSET, or with BatchNormalization older than the opset
    where it got its training mode, converted by onnx's version converter (it
    needs IR < 4 models as they are, initializers still listed as inputs)."""
    import onnx
    from onnx import version_converter

    opset = default_opset(model)
    if any(node.op_type == "BatchNormalization" for node in model.graph.node):
        minimum, why = batchnorm.TRAINING_MODE_OPSET, "BatchNormalization trains in training mode, added at opset 14"
    else:
        minimum, why = MIN_OPSET, "the cross-entropy loss needs SoftmaxCrossEntropyLoss"
    if opset >= minimum:
        return model
    try:
        converted = version_converter.convert_version(model, CONVERTED_OPSET)
    except Exception as error:  # the converter raises bare RuntimeError/IndexError, often without a name
        unknown = [n for n in model.graph.node if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)]
        if unknown:
            error = f"node {unknown[0].name or unknown[0].output[0]!r} has operator {unknown[0].op_type}, not an ONNX operator"
        raise ModelError(
            f"model.path: {where} is at ONNX opset {opset}, below {minimum} ({why}), and onnx's version converter "
            f"cannot convert it to opset {CONVERTED_OPSET} ({str(error).strip()[:200]}); re-export the model at opset "
            f"{CONVERTED_OPSET}"
        ) from None
    log.warning("%s: ONNX opset %d converted to %d by onnx's version converter (ortflow needs opset >= %d: %s)",
                where, opset, CONVERTED_OPSET, minimum, why)
    return converted


def upgrade_ir(model, where: str) -> None:
    """Raise the IR version to the lowest that the model's opsets need (onnx's
    version converter keeps the old one, and so do files converted by hand):
    from IR version 4 on, initializers need not be graph inputs, which
    `drop_initializer_inputs` relies on, and ONNX's checker insists on the
    pairing below it (`... in initializer but not in graph input`)."""
    import onnx

    needed = max(onnx.helper.find_min_ir_version_for(model.opset_import), IR_WITHOUT_INITIALIZER_INPUTS)
    if model.ir_version < needed:
        log.warning("%s: IR version %d raised to %d (what ONNX opset %d needs)", where, model.ir_version, needed,
                    default_opset(model))
        model.ir_version = needed


def drop_initializer_inputs(model, where: str) -> None:
    """Before IR version 4 every initializer was also listed as a graph input;
    ORT's training graphs would define those names twice. Keep only the real inputs."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) < len(model.graph.input):
        log.info("%s: %d initializers listed as graph inputs (IR version < 4 style) are initializers only",
                 where, len(model.graph.input) - len(inputs))
        del model.graph.input[:]
        model.graph.input.extend(inputs)


def drop_unused_initializers(model, where: str) -> None:
    """Initializers that no node reads (left over from a conversion, such as the
    data-queue blobs in Caffe2 models) would be parameters without a gradient,
    which ONNX Runtime's gradient builder cannot place: remove them."""
    read = {name for node in model.graph.node for name in reads(node)} | {o.name for o in model.graph.output}
    unused = [t.name for t in model.graph.initializer if t.name not in read]
    if unused:
        kept = [t for t in model.graph.initializer if t.name in read]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        log.warning("%s: %d initializer(s) that no node reads removed: %s", where, len(unused), unused[:5])


def sums_to_adds(model, where: str) -> None:
    """ONNX Runtime has no gradient for Sum, which converted Caffe2 models use for
    their residual connections: a Sum of n inputs becomes n - 1 Adds (the same
    broadcasting), which have one."""
    import onnx

    def is_sum(node) -> bool:
        return node.op_type == "Sum" and node.domain in ("", "ai.onnx") and len(node.input) >= 2

    sums = sum(map(is_sum, model.graph.node))
    if not sums:
        return
    nodes = []
    for node in model.graph.node:
        if not is_sum(node):
            nodes.append(node)
            continue
        total = node.input[0]
        for index, addend in enumerate(node.input[1:], start=1):
            output = node.output[0] if index == len(node.input) - 1 else f"{node.output[0]}.sum{index}"
            nodes.append(onnx.helper.make_node("Add", [total, addend], [output], name=f"{node.name}.add{index}"))
            total = output
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    log.info("%s: %d Sum node(s) written as Add (ONNX Runtime has a gradient for Add, none for Sum)", where, sums)


def dynamic_batch(model, where: str) -> None:
    """A fixed first dimension of the inputs and outputs (model-zoo files often
    fix a batch of 1) becomes the dynamic `batch`; the shapes recorded inside
    the graph are dropped, to be inferred again."""
    fixed = []
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            fixed.append(f"{value.name!r} {[d.dim_value or d.dim_param for d in dims]}")
            dims[0].dim_param = BATCH
    if fixed:
        del model.graph.value_info[:]
        log.warning("%s: fixed batch dimension of %s made dynamic (%r)", where, ", ".join(fixed), BATCH)
        reshapes = batch_reshapes(model)
        if reshapes:
            log.warning("%s: Reshape node(s) %s to a fixed batch of 1 now reshape to the batch (-1)", where, reshapes[:5])
        check_batch_of_two(model, where, ", ".join(fixed))


def batch_reshapes(model) -> list[str]:
    """Model-zoo files with a fixed batch of 1 reshape to it (ResNet-50's
    `Reshape(x, [1, 2048])` before its classifier): a constant shape that starts
    with 1 and has no -1 gets -1 there, so the batch is inferred. A tensor that
    does not carry the batch still gets 1 (its size is fixed); check_batch_of_two
    then proves that records stay independent. Returns the nodes changed."""
    import numpy as np
    from onnx import numpy_helper

    initializers = {t.name: t for t in model.graph.initializer}
    changed = []
    for node in model.graph.node:
        shape = initializers.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        if shape is None:
            continue
        dims = numpy_helper.to_array(shape)
        if dims.ndim == 1 and dims.size and dims[0] == 1 and -1 not in dims:
            dims = dims.copy()
            dims[0] = -1
            shape.CopyFrom(numpy_helper.from_array(dims.astype(np.int64), shape.name))
            changed.append(node.name or node.output[0])
    return changed


def check_batch_of_two(model, where: str, fixed: str) -> None:
    """A model whose graph computes with its fixed batch (a Reshape to [1, 10]
    that mixes records, say) cannot take other batch sizes: run it on two records
    and on each alone, and the two must give a batch of 2 and the same outputs."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    random = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        shape = [2, *(d.dim_value or 1 for d in tensor.shape.dim[1:])]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        feeds[value.name] = random.normal(size=shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        both = session.run(None, feeds)[0]
        alone = np.concatenate([session.run(None, {k: v[i:i + 1] for k, v in feeds.items()})[0] for i in (0, 1)])
        problem = None if both.shape[:1] == (2,) else f"it returns a batch of {list(both.shape[:1])}"
        if problem is None and not np.allclose(both, alone, rtol=1e-4, atol=1e-5 * (1 + float(np.abs(alone).max()))):
            problem = "its outputs for one record depend on the other"
    except Exception as error:  # whatever ORT raises, the model cannot run at another batch size
        problem = f"it fails: {str(error).strip().splitlines()[0][:300]}"
    if problem:
        raise ModelError(
            f"model.path: {where} has a fixed batch dimension ({fixed}) that its graph depends on: on a batch of "
            f"2 records {problem}; re-export the model with a dynamic batch axis (torch.onnx.export(..., "
            "dynamic_axes={name: {0: 'batch'}}))"
        )


def downgrade_ir(model, where: str) -> None:
    """Rewrite the IR version to 10 when nothing in the model needs a newer one
    (newer writers stamp IR 11 on models that only use older features); else
    say what needs it."""
    opset = default_opset(model)
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


def import_torch(path: str, kwargs):
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
        return cls(**dict(kwargs))
    except TypeError as error:
        raise ModelError(f"model.kwargs: {path}(**{dict(kwargs)!r}) failed: {error}") from None


def forward_features(module, manifest) -> list:
    """The data's features (the columns of the split's manifest, data/manifest.py) in the order `module.forward` takes them: by name where
    its parameters are named like every feature (a tokenizer's input_ids,
    attention_mask and token_type_ids, in whatever order transformers' forward
    lists them), else in the data's order. Text columns (data.text) must go by
    name: a forward that does not take one of the tokenizer's inputs is refused."""
    import inspect

    features = manifest.features
    # A module that takes its features positionally names them (models/hugging_face.py's TaskModel).
    parameters = list(getattr(module, "input_names", None) or inspect.signature(module.forward).parameters)
    names = [f.name for f in features]
    if all(name in parameters for name in names):
        return sorted(features, key=lambda f: parameters.index(f.name))
    if (manifest.tokenizer or {}).get("text"):
        missing = [name for name in names if name not in parameters]
        raise ModelError(
            f"model.path: {type(module).__name__}.forward({', '.join(parameters)}) takes no {', '.join(missing)}, "
            f"which data.tokenizer gives for data.text; name its parameters {', '.join(names)} (any order)"
        )
    return list(features)


def _kind_of(value) -> str:
    return f"the class {value.__qualname__}" if isinstance(value, type) else f"a {type(value).__name__}"
