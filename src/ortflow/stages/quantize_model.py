"""The quantize_model stage: the inference model in, an int8 model and an fp32-versus-int8 report out.

1. `export.quantize` picks the method (`auto`: static where the model has
   convolutions, dynamic where it has only MatMul/Gemm; `none`: no int8 model,
   and metrics.json has the fp32 entry only). ONNX Runtime's pre-processing
   runs first (quantization/preprocess.py); operators that ONNX Runtime has no
   int8 CPU kernel for stay fp32 (quantization/quantizer.py).
2. Both models are evaluated on the whole eval split and timed on ONE intra-op
   thread at batch 1 and 64 (quantization/measure.py); sizes are their file sizes.
   fp32 is timed as pre-processed for quantization, which ONNX Runtime runs as the
   same graph as the exported model but holds about once rather than twice.
3. The quality gate: the int8 model may lose at most `export.max_accuracy_drop`
   (quantization/gate.py). Beyond it the int8 model is refused (still written:
   Snakemake expects it) and metrics.json says so, or with
   `export.gate_fails_run` the stage fails and writes neither.
4. An int8 model no smaller than the fp32 model (a tiny model) is still written,
   since Snakemake expects the file, but flagged: a warning in the log, in
   metrics.json's `warnings`, and in the end-of-run summary, which then offers
   the fp32 model alone.
5. With `export.int4`, a causal LM's export/generation/ also as int4 in
   export/generation-int4/, compared with fp32 (weight bytes, perplexity, greedy
   tokens/s) under the same gate on perplexity: metrics.json's `int4` entry
   (quantization/int4_measure.py). Without it, an earlier run's folder is removed.

Outputs are written to temporary names and renamed when complete.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from .. import external_data
from ..artifacts import Artifacts
from ..config import Config
from ..graphs.description import read_description
from ..quantization import gate, int4_measure, measure, quantizer
from ..quantization.export_metrics import ExportMetrics, Gate, Int4, write_export_metrics
from ..sessions import quiet_logging

log = logging.getLogger("ortflow.quantize")


def quantize(config: Config, model: Path, artifacts: Path, eval_dir: Path, int8: Path, metrics: Path,
             generation: Path, int4: Path) -> ExportMetrics:
    """Quantize `model` into `int8` (unless export.quantize is none), with export.int4 the `generation`
    folder into `int4`, and write the report to `metrics`."""
    import onnx

    from ..data.shards import ShardReader

    quiet_logging()
    info = read_description(Artifacts(artifacts).model_json)
    export_cfg = config.export
    how = quantizer.method(export_cfg, onnx.load(str(model), load_external_data=False))
    if how == "none" and int8.exists():
        # A user who turns quantization off expects no int8 model, not one left from an earlier run.
        int8.unlink()
        log.info("export.quantize is none: removed %s from an earlier run", int8)
    reader = ShardReader(eval_dir, raw=True)  # the exported model standardizes raw features itself
    batch_size = config.train.eval_batch_size
    warnings, gated, int4_entry = [], None, None

    metrics.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=metrics.parent, prefix=".quantize-") as scratch:
        paths = {"fp32": model}
        if how != "none":
            paths["int8"] = Path(scratch) / "model.int8.onnx"
            quantizer.write(model, paths["int8"], int8, how, export_cfg, reader, batch_size)
        # fp32 timed pre-processed: ONNX Runtime's optimizations make it the exported model's graph (the same
        # nodes and weights), loaded without the exported Transposes' folded copy of every weight beside it.
        timed = {**paths, "fp32": quantizer.preprocessed_model(paths["int8"])} if how != "none" else paths
        timings = measure.latencies(timed, reader, measure.latency_batches(info, len(paths)))
        measured = {name: {**measure.evaluate(path, reader, info, batch_size), "latency_ms": timings[name],
                           "size_bytes": external_data.model_bytes(path)} for name, path in paths.items()}
        log.info("fp32 %s int8 (%s%s):\n%s", "without" if how == "none" else "versus", how,
                 ", per channel" if export_cfg.per_channel else "", measure.table(measured))
        if how != "none":
            gated = gate.gate(measured, export_cfg, model, len(reader), gate.remedies(export_cfg, how, reader))
            external_data.replace(paths["int8"], int8)
            measured["int8"]["size_bytes"] = external_data.model_bytes(int8)
            # Snakemake wants the int8 file; metrics.json and the end-of-run summary say when not to use it.
            warning = gate.size_warning(measured, model)
            if warning:
                log.warning(warning)
                warnings.append(warning)
        if export_cfg.int4 is not None:
            entry = int4_measure.write_int4(export_cfg, generation, int4, reader, Path(scratch))
            int4_entry = Int4(**{**entry, "gate": Gate(**entry["gate"])})
        elif int4.exists():  # as with export.quantize: none, no folder left from an earlier run
            shutil.rmtree(int4)
            log.info("export.int4 is null: removed %s from an earlier run", int4)
        report = ExportMetrics(how, export_cfg.per_channel, 1, fp32=measured["fp32"], int8=measured.get("int8"),
                               gate=gated and Gate(**gated), int4=int4_entry, warnings=tuple(warnings),
                               calibration_batches=export_cfg.calibration_batches if how == "static" else None)
        write_export_metrics(metrics, report)
    return report


# The config keys this stage reads, which its rule passes (stages/__init__.py): its section and the
# evaluation batch.
KEYS = ("train.eval_batch_size", "export")
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
    parser.add_argument("--generation", required=True, type=Path,
                        help="a causal LM's generation folder (export_model), read with export.int4")
    parser.add_argument("--int4", required=True, type=Path,
                        help="the int4 generation folder to write (export.int4: null removes it)")


def run(args) -> None:
    from ..config import load_config

    quantize(load_config(args), args.model, args.artifacts, args.eval, args.int8, args.metrics, args.generation,
             args.int4)
