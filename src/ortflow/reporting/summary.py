"""The lines `snakemake` prints when a run ends: where the model is, how good it is, how
training went, and the command that writes the run's report."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..artifacts import Artifacts
from ..checkpoints.meta import META, read_merged
from ..export.ecosystem import MODEL as OPTIMUM_MODEL
from ..export.ecosystem import OPTIMUM
from ..generation import GENAI_CONFIG, GENERATION, SAMPLES, is_seq2seq
from ..graphs.description import ModelDescription, read_description
from ..quantization.export_metrics import Int4
from ..wording import plural
from .results import (baseline_shown, fmt, large_batch, lora_trained, not_beaten, quality, read_export, read_generated,
                      read_json, read_train, refusal, speedup)


def run_summary(results: str | Path, *, train_metrics: str | Path, export_metrics: str | Path, model: str | Path,
                int8: str | Path, checkpoint: str | Path, report: str | Path, reported: Iterable[str | Path] = (),
                targets: Iterable[str] = (), run_arguments: Sequence[str] = (),
                artifacts: str | Path | None = None) -> str:
    """A few lines on what exists of the run in the folder `results`: printed when
    `snakemake` finishes, whichever stages ran. The files are where the rules
    write them (the Snakefile passes their outputs); `report` is the report
    command's page. `run_arguments` are those that chose the run (--configfile,
    --config): the report command needs them too. `artifacts` (build_artifacts'
    folder) tells whether the model's output follows its logits (a final Softmax), and what a
    `kind: transformers` model was fine-tuned from."""
    results, model, int8 = Path(results), Path(model), Path(int8)
    train, export = read_train(train_metrics), read_export(export_metrics)
    model_json = Artifacts(artifacts).model_json if artifacts else None
    # None where the targets stopped before build_artifacts (the doctor alone).
    description = read_description(model_json) if model_json and model_json.is_file() else None
    lines = [f"ortflow: run {results.name} in {results}"]
    outputs = description.outputs if description else None
    lines += model_lines(description) if description else []
    if outputs and outputs.inference and outputs.inference != outputs.logits:
        lines.append(f"  output    {outputs.inference!r} follows the logits {outputs.logits!r} (a final Softmax "
                     "or LogSoftmax, kept in the exported model); the loss is computed on the logits")
    # An int8 model the gate refused, or no smaller than the fp32 one, is not offered (the lines below say why).
    offered = (export is not None and export.int8 is not None and not refusal(export)
               and export.int8["size_bytes"] < export.fp32["size_bytes"])
    lines += exported_lines(model, int8 if int8.is_file() and offered else None)
    if export:
        name, shown = quality(export.fp32)
        line = f"  {name:<9} {shown}"
        if export.int8 is not None:
            line += (f", int8 {quality(export.int8)[1]}, int8 speed-up {fmt(speedup(export), 'ratio')} "
                     f"at batch {large_batch(export)}")
        lines.append(line)
        if refusal(export):
            lines.append(f"  int8      {refusal(export)}: deploy the fp32 model")
        if export.int4 is not None:
            lines.append(int4_line(export.int4, model.parent / f"{GENERATION}-int4"))
    elif train:
        name, shown = quality(train.eval)
        lines.append(f"  {name:<9} {shown} (eval at step {train.steps})")
    if baseline_shown(train):
        lines.append(f"  baseline  {baseline_shown(train)}")
    if train:
        this_attempt = train.steps if train.steps_this_attempt is None else train.steps_this_attempt
        lines.append(f"  training  {train.steps} steps ({this_attempt} in this attempt) in "
                     f"{fmt(train.wall_time_s, 'seconds')}, {fmt(train.samples_per_s, 'rate')} samples/s "
                     f"on {plural(len(train.peak_rss_mb), 'rank')}")
        if train.stopped_early:
            lines.append(f"  stopped   early after step {train.steps}: eval {train.best.metric} had not improved "
                         f"since step {train.best.step}")
    if (Path(checkpoint) / META).is_file():
        merged = read_merged(checkpoint)
        lines.append(f"  exported  the checkpoint of step {merged.step}, the {merged.chosen.shown()}")
    warnings = [*(train.warnings if train else ()), not_beaten(train), *(export.warnings if export else ()),
                earlier_export(train_metrics, export_metrics, run_arguments)]
    lines += [f"  warning   {warning}" for warning in warnings if warning]
    if len(lines) == 1:
        lines.append("  nothing trained yet")
    lines.append(f"  report    {shlex.join(report_command(report, reported, targets, run_arguments))}")
    return "\n".join(lines)


def exported_lines(model: Path, int8: Path | None) -> list[str]:
    """Where the exported models are: `model` with its `int8` one where it is offered, a causal
    LM's generation folder (export/generation/) with the command that generates from it and its
    samples (export/samples.json), and a text classifier's, tagger's or regressor's
    export/optimum/ with the class that loads it."""
    lines = [f"  model     {model}" + (f" (int8: {int8})" if int8 else "")] if model.is_file() else []
    generation = model.parent / GENERATION
    if (generation / GENAI_CONFIG).is_file() or is_seq2seq(generation):
        kind = "an encoder and decoders" if is_seq2seq(generation) else "a decoder"
        lines.append(f"  generate  {shlex.join(['ortflow', 'generate', str(generation), '--prompt', 'your text'])} "
                     f"({kind} with a KV cache in ONNX Runtime)")
    samples = read_generated(model.parent / SAMPLES)
    if samples and samples.samples:
        lines.append(f"  samples   {model.parent / SAMPLES}: {plural(len(samples.samples), 'eval prompt')} "
                     "generated before and after training (the report's Generated samples)")
    optimum = model.parent / OPTIMUM
    architectures = (read_json(optimum / "config.json") or {}).get("architectures") or [""]
    if (optimum / OPTIMUM_MODEL).is_file() and "For" in architectures[0]:
        loader = "ORTModelFor" + architectures[0].split("For", 1)[1]  # BertForTokenClassification's
        lines.append(f"  optimum   {optimum} ({loader}.from_pretrained: the tokenizer's inputs, transformers' "
                     "logits)")
    return lines


def int4_line(int4: Int4, folder: Path) -> str:
    """export.int4's folder with what metrics.json's int4 entry says of it against fp32: the weights'
    size, perplexity and the gate's outcome (a refused folder is named, as deploying it is a choice)."""
    outcome = f"{refusal(int4)}: deploy the fp32 folder" if refusal(int4) else "passed the gate"
    return (f"  int4      {folder}: weights {fmt(int4.weight_ratio, 'ratio')} fp32's, perplexity "
            f"{fmt(int4.int4['perplexity'], 'float')} (fp32 {fmt(int4.fp32['perplexity'], 'float')}), "
            f"{outcome}")


def model_lines(description: ModelDescription) -> list[str]:
    """What build_artifacts' model.json (`description`) says of the model fine-tuned: a `kind:
    transformers` model's class, task and weights, and with LoRA what trained."""
    lines = []
    origin = description.transformers
    if origin:
        weights = "weights drawn from run.seed" if origin["weights"] == "run.seed" else "the folder's weights" + (
            f", a new head drawn from run.seed ({', '.join(origin['new_head'])})" if origin["new_head"] else "")
        lines.append(f"  fine-tune {origin['class']} ({origin['task']}) from {weights}")
    if description.lora:
        lines.append(f"  trained   {lora_trained(description)}")
    return lines


def earlier_export(train_metrics: str | Path, export_metrics: str | Path, run_arguments: Sequence[str]) -> str | None:
    """What to say when the exported model is older than the training (as after `snakemake train`
    with changed settings): the model and figures shown are of the training before. Snakemake
    decides by the same times which stages to run again."""
    train_metrics, export_metrics = Path(train_metrics), Path(export_metrics)
    if not (train_metrics.is_file() and export_metrics.is_file()):
        return None
    if export_metrics.stat().st_mtime >= train_metrics.stat().st_mtime:
        return None
    command = shlex.join(["snakemake", "--cores", "all", *run_arguments])
    return f"the model and its figures above were exported from an earlier training; `{command}` exports this one"


def report_command(report: str | Path, reported: Iterable[str | Path], targets: Iterable[str],
                   run_arguments: Sequence[str]) -> list[str]:
    """The `snakemake --report` command of this run. It refuses to start while a file
    marked for the report (`reported`) does not exist, as after a run of some stages
    (`snakemake merge_checkpoint`): then it reports on this run's `targets` only
    (what they made, with Snakemake's own pages), the workflow's plots and tables
    once `snakemake` has made them. The targets go before `run_arguments`, whose
    --configfile would take them for more files."""
    missing = [path for path in reported if not Path(path).exists()]
    return ["snakemake", "--report", str(report), *(sorted(targets) if missing else ()), *run_arguments]
