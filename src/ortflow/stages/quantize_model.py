"""The quantize_model stage: the inference model in, an int8 model and an fp32-versus-int8 report out.

1. `export.quantize` picks the method (`auto`: static where the model has
   convolutions, dynamic where it has only MatMul/Gemm):
   - `dynamic`: int8 weights, activations quantized on the fly per batch;
   - `static`: QDQ with activation ranges calibrated on `export.calibration_batches`
     eval batches (`train.eval_batch_size` records each) read from the shards;
   - `none`: no int8 model; metrics.json has the fp32 entry only.
   ONNX Runtime's `quant_pre_process` (shape inference, graph optimization) runs
   first; where its shape inference cannot run on a model, it is skipped with a
   warning. Operators that ONNX Runtime has no int8 CPU kernel for stay fp32.
2. Both models are evaluated on the whole eval split (the loss and accuracy or
   perplexity that training reports) and timed on ONE intra-op thread at batch
   1 and 64 (p50 and p95 over interleaved rounds, so that both see the same
   machine load; fewer than 64 where their activations would not fit:
   `latency_batches`); sizes are their file sizes.
3. The quality gate: the int8 model may lose at most `export.max_accuracy_drop`
   accuracy points (perplexity, or the loss of a regression model: that many
   percent relative increase). Beyond it the int8 model is refused: the fp32
   model is the run's product, so the stage warns with both numbers, and
   metrics.json records the gate's outcome `refused`, which the end-of-run
   summary, the report and a sweep's comparison show (none of them offers the
   int8 file, which is still written: Snakemake expects it). With
   `export.gate_fails_run` the stage fails instead, and no int8 model and no
   metrics.json are written. The message suggests only settings not set
   already, and `data.standardize` where the inputs are unscaled floats
   (standardize.unscaled).
4. An int8 model no smaller than the fp32 model (a tiny model) is still written,
   since Snakemake expects the file, but flagged: a warning in the log, in
   metrics.json's `warnings`, and in the end-of-run summary, which then offers
   the fp32 model alone.

Outputs are written to temporary names and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import atomic, external_data, ort_private
from ..artifacts import Artifacts
from ..data import standardize
from ..config import Config
from ..errors import ModelError
from ..evaluation import batch_totals, eval_results
from ..inference import inference_session, input_feeds, loss_of, set_metadata
from ..sessions import quiet_logging
from ..training.preflight import available_memory

log = logging.getLogger("ortflow.quantize")

# The batches timed: one record, and LATENCY_BATCH where the activations fit (latency_batches).
LATENCY_BATCH = 64
LATENCY_ROUNDS = 20
LATENCY_RUNS_PER_ROUND = 10
# A large model gets fewer rounds rather than minutes of timing; never fewer than MIN_ROUNDS.
LATENCY_BUDGET_S = 10.0
MIN_ROUNDS = 3


class QualityGateError(ModelError):
    """The int8 model lost more than `export.max_accuracy_drop` allows."""


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


def preprocess(source: Path, target: Path) -> None:
    """ONNX Runtime's quantization pre-processing (`quant_pre_process`: symbolic shape
    inference, ONNX Runtime's basic graph optimizations, ONNX's shape inference); where its
    symbolic shape inference cannot run (it raises TypeError on inputs of unknown shape, as
    some exports at newer opsets have), without it, and at worst the model as it is."""
    attempts = [{}, {"skip_symbolic_shape": True}, {"skip_symbolic_shape": True, "skip_onnx_shape": True}]
    for skip in attempts:
        try:
            pre_process(source, target, **skip)
            return
        except Exception as error:  # ORT's pre-processing fails in many ways; quantization works without it
            log.warning("quantization pre-processing%s failed on %s (%s: %s); retrying without %s",
                        f" ({', '.join(skip)})" if skip else "", source, type(error).__name__,
                        str(error).strip()[:200], "shape inference" if skip else "symbolic shape inference")
    # As it is, with its external data copied under the name the copy's tensors give it.
    external_data.save_model(external_data.load_model(source), target)


def pre_process(source: Path, target: Path, skip_symbolic_shape: bool = False, skip_onnx_shape: bool = False) -> None:
    """The steps of ONNX Runtime's `quant_pre_process`, each on a file whose weights stay in
    its external data: `quant_pre_process` reads the weights whole and holds them through
    every step (on a GPT of 86M parameters, 7.5 times their size at its peak). The steps'
    files go beside `target` with the source's data file linked there (no copy), since
    ONNX Runtime and ONNX find a model's external data beside it."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization.quant_utils import add_pre_process_metadata
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    folder = target.parent
    step, optimized = folder / "pre-process.onnx", folder / "optimized.onnx"
    linked = folder / external_data.data_file(source).name  # where `step`'s tensors find their data
    if external_data.data_file(source).is_file():
        linked.unlink(missing_ok=True)
        os.link(external_data.data_file(source), linked)
    graph = external_data.load_model(source, load_data=False)
    if not skip_symbolic_shape:
        with contextlib.chdir(source.parent):  # where it finds the data of a tensor whose value it reads
            graph = SymbolicShapeInference.infer_shapes(graph)
    onnx.save(graph, str(step))
    del graph
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(optimized)
    # The session only writes the optimized model: no packed copy of the MatMul weights for running it.
    options.add_session_config_entry("session.disable_prepacking", "1")
    if is_external(source):
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         external_data.data_file(optimized).name)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                         str(external_data.INLINE_BYTES))
    ort.InferenceSession(str(step), options, providers=["CPUExecutionProvider"])  # writes `optimized`
    if not skip_onnx_shape:
        onnx.shape_inference.infer_shapes_path(str(optimized), str(optimized))
    graph = external_data.load_model(optimized, load_data=False)
    add_pre_process_metadata(graph)
    external_data.save_graph(graph, optimized, target)
    for scratch in (step, optimized, linked):
        scratch.unlink(missing_ok=True)


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


def quantize_file(source: Path, target: Path, how: str, export_cfg, reader, batch_size: int) -> None:
    """Pre-processing, then dynamic or static (QDQ, u8 activations, s8 weights)
    quantization of the operator types ONNX Runtime has int8 CPU kernels for:
    an operator it cannot load quantized is found by loading the result, and kept fp32."""
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry

    preprocessed = target.with_name("preprocessed.onnx")
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


def is_external(model: Path) -> bool:
    """Whether the model keeps its weights in external data (the exported model over external_data.threshold())."""
    return external_data.uses_external_data(external_data.load_model(model, load_data=False))


def evaluate(path: Path, reader, info: dict, batch_size: int) -> dict:
    """What training's evaluation reports (`evaluation.eval_results`), for an inference model."""
    logits_name = info["outputs"]["logits"]
    session = inference_session(path, also=(logits_name,), prepacked=False)
    totals = np.zeros(3)
    for batch in reader.eval_batches(0, 1, batch_size):
        logits = session.run([logits_name], input_feeds(session, batch))[0]
        labels = batch[reader.label_name]
        totals += batch_totals(loss_of(logits, labels, info["loss"]), logits, labels, info)
    return eval_results(totals, info["task"])


def latency_batches(info: dict, sessions: int) -> tuple[int, ...]:
    """(1, LATENCY_BATCH), or a second batch as large as fits (none where one record is all that
    fits, rather than timing batch 1 twice): `sessions` sessions timed side by
    side, each holding what model.json's eval_bytes_per_sample says an evaluation holds per
    record, within half the memory available (preflight.available_memory: MemAvailable, the
    cgroup's limit or ORTFLOW_MEMORY_AVAILABLE), the rest for the weights and ONNX Runtime's
    arenas, which hold more than that ideal node-by-node count."""
    per_record = sessions * info.get("eval_bytes_per_sample", 0)
    if not per_record:  # artifacts built before evaluations were counted
        return 1, LATENCY_BATCH
    available, where = available_memory()
    fits = max(1, min(LATENCY_BATCH, int(available / 2 // per_record)))
    if fits < LATENCY_BATCH:
        log.info("latency timed at batch 1%s, not %d: %d session(s) of %.0f MB a record in half the %.1f GiB "
                 "available (%s)", f" and {fits}" if fits > 1 else " alone", LATENCY_BATCH, sessions,
                 per_record / sessions / 1e6, available / 2**30, where)
    return (1, fits) if fits > 1 else (1,)


def latencies(paths: dict[str, Path], reader, batches: tuple[int, ...]) -> dict[str, dict]:
    """{model: {b1_p50, b1_p95, b64_p50, b64_p95}} in ms on one thread (64: the second of
    `batches`, if there is one), the models timed in turns."""
    sessions = {name: inference_session(path, threads=1) for name, path in paths.items()}
    indices = np.arange(max(batches)) % len(reader)  # a small eval split repeats records
    out: dict[str, dict] = {name: {} for name in paths}
    for size in batches:
        batch = reader.gather(indices[:size])
        feeds = {name: input_feeds(session, batch) for name, session in sessions.items()}
        times: dict[str, list] = {name: [] for name in paths}
        budget = LATENCY_BUDGET_S / len(batches)
        started = time.perf_counter()
        for name, session in sessions.items():  # warm-up: allocations, caches
            session.run(None, feeds[name])
        # Fewer runs a round where one run of each model takes long (GPT-2 124M: tens of seconds at b64).
        runs = max(1, min(LATENCY_RUNS_PER_ROUND, int(budget / (MIN_ROUNDS * (time.perf_counter() - started)))))
        for name, session in sessions.items():
            for _ in range(runs - 1):
                session.run(None, feeds[name])
        deadline = time.perf_counter() + budget
        for round_ in range(LATENCY_ROUNDS):
            if round_ >= MIN_ROUNDS and time.perf_counter() > deadline:
                break
            for name, session in sessions.items():
                for _ in range(runs):
                    started = time.perf_counter()
                    session.run(None, feeds[name])
                    times[name].append(time.perf_counter() - started)
        for name in paths:
            out[name][f"b{size}_p50"] = float(np.percentile(times[name], 50) * 1e3)
            out[name][f"b{size}_p95"] = float(np.percentile(times[name], 95) * 1e3)
    return out


def quality_drop(fp32: dict, int8: dict) -> tuple[str, float, str]:
    """(what is compared, how much int8 loses, its unit): accuracy points, or the
    relative increase in percent of the perplexity or (regression) the loss."""
    if "perplexity" in fp32:
        return "perplexity", (int8["perplexity"] / fp32["perplexity"] - 1) * 100, "%"
    if "accuracy" in fp32:
        return "accuracy", (fp32["accuracy"] - int8["accuracy"]) * 100, "points"
    return "loss", (int8["loss"] / fp32["loss"] - 1) * 100 if fp32["loss"] else 0.0, "%"


def table(report: dict) -> str:
    """The report as rows of quality, latency and size, with how int8 compares."""
    from tabulate import tabulate

    fp32, int8 = report["fp32"], report.get("int8")
    rows = []
    for key in ("loss", "accuracy", "perplexity"):
        if key in fp32:
            scale = 100 if key == "accuracy" else 1
            change = [f"{(int8[key] - fp32[key]) * scale:+.4g}"] if int8 else []
            rows.append([f"{key} (%)" if key == "accuracy" else key, fp32[key] * scale,
                         *([int8[key] * scale] if int8 else []), *change])
    for key, value in fp32["latency_ms"].items():
        quantized = int8["latency_ms"][key] if int8 else None
        change = [f"{value / quantized:.2f}x faster"] if int8 else []
        rows.append([f"latency {key} (ms, 1 thread)", value, *([quantized] if int8 else []), *change])
    size = [f"{fp32['size_bytes'] / int8['size_bytes']:.2f}x smaller"] if int8 else []
    rows.append(["size (KiB)", fp32["size_bytes"] / 1024, *([int8["size_bytes"] / 1024] if int8 else []), *size])
    headers = ["", "fp32", "int8", "int8 vs fp32"] if int8 else ["", "fp32"]
    return tabulate(rows, headers=headers, floatfmt=".4g")


def gate(report: dict, export_cfg, model: Path, records: int, remedies: list[str]) -> dict:
    """The quality gate's entry of the report, its `outcome` `passed` or `refused` (int8 loses
    too much, said in a warning that names the `remedies`); QualityGateError instead of
    `refused` with export.gate_fails_run. For accuracy it says what one record is worth:
    on a tiny eval split one wrong answer is already several points."""
    compared, drop, unit = quality_drop(report["fp32"], report["int8"])
    allowed = export_cfg.max_accuracy_drop
    granularity = f" (one of the {records} eval records is {100 / records:.3g} points)" if compared == "accuracy" else ""
    entry = {"metric": compared, "drop": drop, "unit": unit, "max_accuracy_drop": allowed}
    if drop <= allowed:
        log.info("quality gate passed: int8 loses %.4g %s of %s (allowed: %g)%s", drop, unit, compared, allowed,
                 granularity)
        return {**entry, "outcome": "passed"}
    scale = 100 if compared == "accuracy" else 1
    refusal = (f"quality gate: int8 {compared} {report['int8'][compared] * scale:.4g} against fp32 "
               f"{report['fp32'][compared] * scale:.4g} is a loss of {drop:.4g} {unit}, more than "
               f"export.max_accuracy_drop={allowed}{granularity}")
    remedy = f"(try {'; '.join(remedies)})"
    if export_cfg.gate_fails_run:
        raise QualityGateError(f"{refusal}; no int8 model is written and the fp32 model {model} stays "
                               f"(export.gate_fails_run) {remedy}")
    log.warning("%s; the int8 model is refused (metrics.json: gate outcome refused): deploy the fp32 model %s %s",
                refusal, model, remedy)
    return {**entry, "outcome": "refused"}


def remedies(export_cfg, how: str, reader) -> list[str]:
    """What may bring the int8 model within the gate, of the settings not set
    already: standardized inputs where they are unscaled floats (with the data
    as the model takes it), static quantization, per-channel weights."""
    found = []
    if not reader.standardized:
        columns = reader.manifest["source"]["data"]["features"]
        batches = ({name: batch[name] for name in reader.feature_names} for batch in reader.eval_batches(0, 1, 256))
        problem = standardize.unscaled(batches, columns)
        if problem:
            found.append(f"data.standardize: true ({problem})")
    if how != "static":
        found.append("export.quantize: static")
    if not export_cfg.per_channel:
        found.append("export.per_channel: true")
    return [*found, "a larger export.max_accuracy_drop", "or export.quantize: none"]


def size_warning(report: dict, model: Path) -> str | None:
    """The line that says the int8 model is no smaller than the fp32 model (a
    tiny model: the scales, zero points and quantization nodes outweigh what its
    few weights save), or None."""
    fp32, int8 = report["fp32"]["size_bytes"], report["int8"]["size_bytes"]
    if int8 < fp32:
        return None
    return (f"the int8 model ({int8 / 1024:.3g} KiB) is {int8 / fp32:.3g}x the size of the fp32 model "
            f"({fp32 / 1024:.3g} KiB): on a model this small the quantization's scales, zero points and nodes "
            f"outweigh what int8 saves on the weights; deploy the fp32 model {model}, and set export.quantize: "
            "none to skip int8")


def quantize(config: Config, model: Path, artifacts: Path, eval_dir: Path, int8: Path, metrics: Path) -> dict:
    """Quantize `model` into `int8` (unless export.quantize is none) and write the report to `metrics`."""
    import onnx

    from ..data.shards import ShardReader

    quiet_logging()
    info = Artifacts(artifacts).description()
    export_cfg = config.export
    how = method(export_cfg, onnx.load(str(model), load_external_data=False))
    if how == "none" and int8.exists():
        # A user who turns quantization off expects no int8 model, not one left from an earlier run.
        int8.unlink()
        log.info("export.quantize is none: removed %s from an earlier run", int8)
    reader = ShardReader(eval_dir, raw=True)  # the exported model standardizes raw features itself
    batch_size = config.train.eval_batch_size
    report: dict = {"quantize": how, "per_channel": export_cfg.per_channel, "threads": 1, "warnings": []}
    if how == "static":
        report["calibration_batches"] = export_cfg.calibration_batches

    metrics.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=metrics.parent, prefix=".quantize-") as scratch:
        paths = {"fp32": model}
        if how != "none":
            paths["int8"] = Path(scratch) / "model.int8.onnx"
            quantize_file(model, paths["int8"], how, export_cfg, reader, batch_size)
            quantized = external_data.load_model(paths["int8"], load_data=False)  # the graph; weights stay
            source_props = {p.key: p.value for p in onnx.load(str(model), load_external_data=False).metadata_props}
            set_metadata(quantized, {**source_props, "ortflow.quantize": how})
            external_data.save_graph(quantized, paths["int8"], paths["int8"], int8)
            del quantized
        timings = latencies(paths, reader, latency_batches(info, len(paths)))
        for name, path in paths.items():
            report[name] = {**evaluate(path, reader, info, batch_size), "latency_ms": timings[name],
                            "size_bytes": external_data.model_bytes(path)}
        log.info("fp32 %s int8 (%s%s):\n%s", "without" if how == "none" else "versus", how,
                 ", per channel" if export_cfg.per_channel else "", table(report))
        if how != "none":
            report["gate"] = gate(report, export_cfg, model, len(reader), remedies(export_cfg, how, reader))
            external_data.replace(paths["int8"], int8)
            report["int8"]["size_bytes"] = external_data.model_bytes(int8)
            # Snakemake wants the int8 file; metrics.json and the end-of-run summary say when not to use it.
            warning = size_warning(report, model)
            if warning:
                log.warning(warning)
                report["warnings"].append(warning)
        atomic.write_text(metrics, json.dumps(report, indent=2) + "\n")
    return report


HELP = "quantize the inference model to int8 and report fp32 versus int8 (quality, latency, size), with a quality gate"


def add_arguments(parser) -> None:
    from ..config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--model", required=True, type=Path, help="the fp32 inference model (export_model)")
    parser.add_argument("--artifacts", required=True, type=Path, help="the build_artifacts folder (model.json)")
    parser.add_argument("--eval", required=True, type=Path, help="the eval shards")
    parser.add_argument("--int8", required=True, type=Path,
                        help="the int8 model to write (export.quantize: none removes it)")
    parser.add_argument("--metrics", required=True, type=Path, help="the fp32-versus-int8 report (JSON)")


def run(args) -> None:
    from ..config import load_config

    quantize(load_config(args), args.model, args.artifacts, args.eval, args.int8, args.metrics)
