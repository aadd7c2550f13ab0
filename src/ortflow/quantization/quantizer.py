"""The int8 model. `export.quantize` picks the method (`auto`: static where the model has
convolutions, dynamic where it has only MatMul/Gemm):

- `dynamic`: int8 weights, activations quantized on the fly per batch;
- `static`: QDQ with activation ranges calibrated on `export.calibration_batches` eval
  batches (`train.eval_batch_size` records each) read from the shards;
- `none`: no int8 model.

The model is pre-processed first (preprocess.py). Operators that ONNX Runtime has no int8
CPU kernel for stay fp32: each one is found by loading the quantized model, and the model
is quantized again without it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .. import external_data, ort_private
from ..errors import ModelError
from ..inference import set_metadata
from ..sessions import inference_session
from .preprocess import preprocess

log = logging.getLogger("ortflow.quantize")

# Convolutions: dynamic quantization has no int8 kernel for them (below), static QDQ does.
CONVOLUTIONS = ("Conv", "ConvTranspose")
# Dynamic quantization turns Conv into ConvInteger, which ONNX Runtime 1.19's CPU
# provider implements for uint8 weights only (NOT_IMPLEMENTED with int8 weights).
NO_DYNAMIC_INT8_KERNEL = ("Conv",)
# Rounds of "quantize, load, keep the operator ONNX Runtime cannot load in fp32".
MAX_EXCLUSION_ROUNDS = 8


def method(export_cfg, model) -> str:
    """`export.quantize`, with `auto` chosen by the model's operators."""
    if export_cfg.quantize == "auto":
        return "static" if any(node.op_type in CONVOLUTIONS for node in model.graph.node) else "dynamic"
    return export_cfg.quantize


def calibration_reader(reader, input_names: list[str], batch_size: int, batches: int):
    from onnxruntime.quantization import CalibrationDataReader

    class EvalBatches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(list(reader.eval_batches(0, 1, batch_size))[:batches])

        def get_next(self):
            batch = next(self.batches, None)
            return None if batch is None else {name: batch[name] for name in input_names}

    return EvalBatches()


def unloadable_node(path: Path) -> str | None:
    """The name of the node that ONNX Runtime's CPU provider has no kernel for, or None if the model loads."""
    import re

    try:
        inference_session(path, prepacked=False)
    except ort_private.not_implemented_error() as error:
        match = re.search(r"node with name '([^']*)'", str(error))
        if match:
            return match.group(1)
        raise
    return None


def preprocessed_model(target: Path) -> Path:
    """The pre-processed fp32 model that quantize_file leaves beside the int8 `target`: the
    model ONNX Runtime runs from the source, with its weights' Transposes already folded (the
    latency step times it: quantize_model.py)."""
    return target.with_name("preprocessed.onnx")


def quantize_file(source: Path, target: Path, how: str, export_cfg, reader, batch_size: int) -> None:
    """Pre-processing, then dynamic or static (QDQ, u8 activations, s8 weights)
    quantization of the operator types ONNX Runtime has int8 CPU kernels for:
    an operator it cannot load quantized is found by loading the result, and kept fp32."""
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry

    preprocessed = preprocessed_model(target)
    preprocess(source, preprocessed)
    graph = external_data.load_model(preprocessed, load_data=False)
    # ONNX Runtime writes the int8 model's weights to `<target>.data` too.
    external = external_data.uses_external_data(graph)
    nodes = graph.graph.node
    present = {node.op_type for node in nodes}
    by_name = {node.name: node.op_type for node in nodes}
    registry = IntegerOpsRegistry if how == "dynamic" else QDQRegistry
    excluded = set(NO_DYNAMIC_INT8_KERNEL if how == "dynamic" else ())
    for _ in range(MAX_EXCLUSION_ROUNDS):
        op_types = sorted(t for t in registry if t in present and t not in excluded)
        quantize_once(preprocessed, target, how, op_types, export_cfg, reader, batch_size, external)
        node = unloadable_node(target)
        if node is None:
            kept = sorted(t for t in excluded if t in present)
            if kept:
                log.info("kept fp32 (no int8 CPU kernel in ONNX Runtime for %s quantization): %s", how, kept)
            return
        op_type = by_name.get(node.removesuffix("_quant"))
        if op_type is None or op_type in excluded:
            raise ModelError(f"quantize_model: ONNX Runtime cannot load the {how} int8 model: no CPU kernel for "
                             f"node {node!r}; set export.quantize to another method or none")
        log.warning("ONNX Runtime has no int8 CPU kernel for node %r (operator %s, %s quantization): %s nodes "
                    "stay fp32", node, op_type, how, op_type)
        excluded.add(op_type)
    raise ModelError(f"quantize_model: {how} quantization still fails to load after keeping {sorted(excluded)} "
                     "in fp32; set export.quantize to another method or none")


def quantize_once(source: Path, target: Path, how: str, op_types: list[str], export_cfg, reader,
                  batch_size: int, external: bool) -> None:
    """One quantization of `source` to `target`; `external`: the source keeps its weights in external data."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    per_channel = export_cfg.per_channel
    if how == "dynamic":
        with ort_private.dynamic_quantizer_reads_weights_once():
            quantize_dynamic(str(source), str(target), op_types_to_quantize=op_types, per_channel=per_channel,
                             weight_type=QuantType.QInt8, use_external_data_format=external)
        return
    names = [i.name for i in inference_session(source, prepacked=False).get_inputs()]
    batches = export_cfg.calibration_batches
    log.info("calibrating on %d eval batch(es) of up to %d records", min(batches, -(-len(reader) // batch_size)),
             batch_size)
    quantize_static(
        str(source),
        str(target),
        calibration_reader(reader, names, batch_size, batches),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=op_types,
        per_channel=per_channel,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        use_external_data_format=external,
    )


def write(source: Path, target: Path, final: Path, how: str, export_cfg, reader, batch_size: int) -> None:
    """`source` quantized into `target` (quantize_file), with the source's metadata properties and
    `ortflow.quantize`; its external data, if any, named for `final`, where it is renamed to later."""
    import onnx

    quantize_file(source, target, how, export_cfg, reader, batch_size)
    quantized = external_data.load_model(target, load_data=False)  # the graph; weights stay
    source_props = {p.key: p.value for p in onnx.load(str(source), load_external_data=False).metadata_props}
    set_metadata(quantized, {**source_props, "ortflow.quantize": how})
    external_data.save_graph(quantized, target, target, final)
