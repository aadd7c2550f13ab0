"""The checks the inference model must pass before it is renamed into place, besides
`onnx.checker.check_model(full_check=True)` (with shape inference):

- its interface: the data's features as inputs, the model's output as the one output,
  a dynamic batch dimension (check_interface);
- on a batch of eval records, its logits (the model's output, or the Softmax's input
  inside it) equal the eval graph's on the same weights (within TOLERANCE, scaled to the
  logits: the two graphs differ only in the loss behind the logits), and the loss computed
  from them (`loss_of`, which quantize_model also uses) equals the eval graph's loss. With
  `data.standardize` the exported model is fed the raw features, the eval graph the same
  records standardized (check_outputs);
- ONNX's reference evaluator agrees with ONNX Runtime within TOLERANCE. It is a second
  opinion, not a gate: where it disagrees (or fails) while the eval graph agrees, the log
  warns and names the first operator it evaluates differently, and the model is exported
  (check_reference);
- with a dynamic sequence dimension, at 1 token and at twice data.context (or the most
  positions the model has) its output has that length and, for a language model, the
  first positions' logits are those at data.context (check_sequence_lengths).

With `model.lora` the exported model, whose adapters are merged, is compared with the eval
graph, where they run unmerged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import external_data
from ..artifacts import Artifacts
from ..checkpoints.ort_format import read_ort_checkpoint
from ..errors import ModelError
from ..evaluation import feeds, outputs_of
from ..graphs.description import ModelDescription
from ..inference import inference_output, input_feeds, loss_of
from ..machine import release_freed_memory
from ..models import DECODER_INPUT_IDS
from ..models.torch_export import SEQUENCE, TARGET_SEQUENCE
from ..sessions import inference_session, training_options

log = logging.getLogger("ortflow.export")

# The eval records the exported model is checked on.
CHECK_RECORDS = 64
# The reference evaluator is plain numpy and slow on large models: a few records prove agreement.
REFERENCE_RECORDS = 8
# Allowed: max |actual - expected| <= relative x max |expected| + absolute.
# Scaled to the outputs because float32 rounding is: the exported model and the
# eval graph have the same nodes and weights, yet an inference session that
# pre-packs the constant Gemm weights for MLAS sums the products in another order
# than the eval graph, whose weights are inputs (~1e-5 on the default config at
# step 400, logits up to 24). The checks' sessions run without pre-packing, which
# also holds the weights once, and agreed bit for bit on a 554M gpt; ONNX
# Runtime's graph optimizations may still fuse the constant-weight graph otherwise.
TOLERANCE = {"relative": 1e-4, "absolute": 1e-6}


class ExportError(ModelError):
    """The exported model fails a check; the message says which and by how much."""


def check_interface(model, info: ModelDescription, where: Path) -> None:
    """The data's feature names as inputs, the model's output as the one output, a dynamic batch dimension."""
    expected = sorted(i.name for i in info.inputs)
    inputs = sorted(i.name for i in model.graph.input)
    if inputs != expected:
        raise ExportError(f"{where}: inputs {inputs}, expected the data's features {expected}")
    outputs = [o.name for o in model.graph.output]
    if outputs != [inference_output(info)]:
        raise ExportError(f"{where}: outputs {outputs}, expected [{inference_output(info)!r}]")
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims and not dims[0].dim_param:
            raise ExportError(
                f"{where}: {value.name!r} has a fixed batch dimension {dims[0].dim_value}; "
                "the model must accept any batch size (a dynamic first dimension)"
            )


def difference(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(largest absolute difference, what TOLERANCE allows for `expected`); NaN
    or a shape mismatch makes the difference infinite."""
    expected = np.asarray(expected, dtype=np.float64)
    allowed = TOLERANCE["relative"] * (float(np.abs(expected).max()) if expected.size else 0.0) + TOLERANCE["absolute"]
    if np.shape(actual) != expected.shape:
        return float("inf"), allowed
    worst = float(np.abs(np.asarray(actual, dtype=np.float64) - expected).max()) if expected.size else 0.0
    return (worst if worst == worst else float("inf")), allowed


def compare(name: str, actual: np.ndarray, expected: np.ndarray) -> float:
    """The largest absolute difference, after checking it against TOLERANCE."""
    worst, allowed = difference(actual, expected)
    if not worst <= allowed:
        raise ExportError(
            f"{name}: shapes {list(np.shape(actual))} and {list(np.shape(expected))}, largest difference {worst:.3g} "
            f"(allowed: {allowed:.3g} = {TOLERANCE['relative']:g} x the largest |value| + {TOLERANCE['absolute']:g})"
        )
    return worst


def eval_graph_outputs(files: Artifacts, checkpoint: Path, info: ModelDescription, eval_batch: dict,
                       data_label: str) -> tuple[float, np.ndarray]:
    """(loss, logits) of the eval graph on `eval_batch` with the merged `checkpoint`'s weights,
    fed as the training Module's eval step feeds them, as inputs; here to a plain session, from
    the checkpoint's arrays (views of its file): a Module would hold them a second time."""
    import onnxruntime as ort

    weights = read_ort_checkpoint(checkpoint).parameters
    session = ort.InferenceSession(str(files.eval_model), training_options(), providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]
    data = [name for name in names if name not in weights]
    inputs = dict(zip(data, feeds(eval_batch, data, info.label.name, data_label)))
    return outputs_of(session.run(None, inputs | {name: weights[name] for name in names if name in weights}))


def check_outputs(path: Path, info: ModelDescription, batch: dict, expected: tuple[float, np.ndarray],
                  data_label: str) -> np.ndarray:
    """The exported model on `batch` against the eval graph's (loss, logits) on the same
    weights and records (`expected`, from eval_graph_outputs: standardized where the exported
    model standardizes itself), then ONNX's reference evaluator, each with the other's weights
    out of memory. Returns the exported model's output on `batch`."""
    names = list(dict.fromkeys([inference_output(info), info.outputs.logits]))
    session = inference_session(path, also=tuple(names), prepacked=False)
    results = dict(zip(names, session.run(names, input_feeds(session, batch))))
    few = {name: array[:REFERENCE_RECORDS] for name, array in input_feeds(session, batch).items()}
    del session
    logits = results[info.outputs.logits]
    eval_loss, eval_logits = expected
    worst = compare("exported logits vs the eval graph's", logits, eval_logits)
    loss = loss_of(logits, batch[data_label], info.loss)
    compare("loss from the exported logits vs the eval graph's", np.array(loss), np.array(eval_loss))
    log.info("%d eval records: logits within %.3g of the eval graph's, loss %.6g (eval graph %.6g)",
             len(batch[data_label]), worst, loss, eval_loss)
    check_reference(path, few, results[inference_output(info)][:REFERENCE_RECORDS])
    # The session's and the reference evaluator's weights, freed, are still held by glibc's heap (1 W of
    # the 101M gpt of tests/test_external_data.py), under what export builds next.
    release_freed_memory()
    return results[inference_output(info)]


def check_reference(path: Path, feeds: dict, output: np.ndarray) -> None:
    """ONNX's reference evaluator against ONNX Runtime's output; a warning naming
    the operator where it disagrees (onnx 1.17's GatherElements, for one, fails
    on some shapes that ONNX Runtime evaluates correctly)."""
    from onnx.reference import ReferenceEvaluator

    model = external_data.load_model(path, load_data=False)
    # Weights in external data are fed as inputs, read once into arrays (a 554M GPT: 2.2 GB less).
    weights = external_data.weights_as_inputs(model, path)
    try:
        # One record at a time: the evaluator keeps every tensor it computes until its run ends,
        # which for 8 records of a 86M-parameter GPT was 1.7 GB, five times the weights.
        evaluator = ReferenceEvaluator(model)
        computed = [evaluator.run(None, {name: array[i:i + 1] for name, array in feeds.items()} | weights)[0]
                    for i in range(len(output))]
        worst, allowed = difference(np.concatenate(computed), output)
        problem = f"differs from ONNX Runtime by {worst:.3g} (allowed: {allowed:.3g})"
    except Exception as error:  # any failure of the second opinion is reported, not raised
        worst, allowed, problem = float("inf"), 0.0, f"fails ({type(error).__name__}: {str(error).strip()[:200]})"
    if worst <= allowed:
        log.info("ONNX reference evaluator agrees with ONNX Runtime on %d records: largest difference %.3g "
                 "(allowed: %.3g)", len(output), worst, allowed)
        return
    try:
        where = first_disagreement(model, feeds | weights)
    except Exception as error:  # the search is a diagnosis; its own failure must not block the export
        where = f"a node not singled out ({type(error).__name__}: {str(error).strip()[:100]})"
    log.warning("ONNX's reference evaluator %s on %d records, at %s, while ONNX Runtime's eval graph agrees with "
                "the exported model; the model is exported (the reference evaluator is taken to be wrong there)",
                problem, len(output), where)


def first_disagreement(model, feeds: dict) -> str:
    """'node N (operator Op)': the first node whose outputs ONNX's reference
    evaluator computes differently from ONNX Runtime, each fed ONNX Runtime's
    values of the node's inputs."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    names = [name for node in probe.graph.node for name in node.output if name and name not in known]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every node's output
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer} | dict(feeds)
    values |= dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    for node in model.graph.node:
        where = f"node {node.name or node.output[0]!r} (operator {node.op_type})"
        try:
            outputs = ReferenceEvaluator(node).run(None, {name: values[name] for name in node.input if name})
        except Exception:  # the evaluator fails on this node
            return where
        for name, output in zip(node.output, outputs):
            worst, allowed = difference(output, values[name])
            if name and not worst <= allowed:
                return where
    return "no single node (each agrees on ONNX Runtime's inputs)"


def lengthened(tokens: np.ndarray, length: int) -> np.ndarray:
    """`tokens` [batch, n] repeated along the sequence and cut to [batch, length]."""
    return np.concatenate([tokens] * -(-length // tokens.shape[1]), axis=1)[:, :length]


def check_sequence_lengths(path: Path, info: ModelDescription, batch: dict, output: np.ndarray, limit: int | None) -> None:
    """A text model exported with a dynamic sequence dimension (models/torch_export.py) run on
    `batch` at 1 token and at twice data.context (or the most positions the model has, `limit`):
    its output must have that length where the training length's `output` has it and, for a
    language model (causal: a position sees only those before it), the first positions' scores
    must be those of the training length's run (for a sequence-to-sequence model, at other
    lengths of its target, `decoder_input_ids`)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    sequences = [v.name for v in model.graph.input
                 if len(v.type.tensor_type.shape.dim) > 1
                 and v.type.tensor_type.shape.dim[1].dim_param in (SEQUENCE, TARGET_SEQUENCE)]
    if not sequences:
        return
    # A sequence-to-sequence model reads its whole source at each target position: its target is what
    # is causal, and what is run at other lengths.
    sequences = [name for name in sequences if name == DECODER_INPUT_IDS] or sequences
    dims = model.graph.output[0].type.tensor_type.shape.dim
    axis = next((i for i, d in enumerate(dims) if d.dim_param in (SEQUENCE, TARGET_SEQUENCE)), None)
    context = batch[sequences[0]].shape[1]
    session = inference_session(path, prepacked=False)
    lengths = sorted({1, min(2 * context, limit or 2 * context)})
    for length in lengths:
        feeds = input_feeds(session, {name: lengthened(array, length) if name in sequences else array
                                      for name, array in batch.items()})
        try:
            scores = session.run([model.graph.output[0].name], feeds)[0]
        except Exception as error:  # ONNX Runtime's own error names the node
            unknown = "" if limit else (" (the model has no transformers config that gives n_positions or "
                                        "max_position_embeddings, so it is run at twice data.context)")
            raise ExportError(f"{path}: the model's sequence dimension is dynamic, but it fails at {length} token(s)"
                              f"{unknown}, data.context being {context}: {str(error).strip()[:300]}") from None
        expected = [length if i == axis else size for i, size in enumerate(output.shape)]
        if list(scores.shape) != expected:
            raise ExportError(f"{path}: at {length} token(s) its output has shape {list(scores.shape)}, expected "
                              f"{expected} (at data.context={context}: {list(output.shape)})")
        if info.task == "language_model" and axis is not None:
            shared = min(length, context)
            compare(f"the first {shared} position(s)' logits at {length} token(s) vs at data.context={context}",
                    scores.take(range(shared), axis), output.take(range(shared), axis))
    log.info("dynamic sequence length: %d eval records at %s token(s) (data.context %d%s) give outputs of that "
             "length%s", len(output), " and ".join(map(str, lengths)), context,
             f", positions up to {limit}" if limit else "",
             ", and the first positions' logits those of data.context" if info.task == "language_model" else "")
