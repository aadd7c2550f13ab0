"""The files one stage writes and others read, as records (records.py): a split's shard manifest
(data/manifest.py), the model description (graphs/description.py), a checkpoint's manifest
(checkpoints/manifest.py), a merged checkpoint's meta.json (checkpoints/meta.py), a run's
train/metrics.json (training/run_summary.py) and export/metrics.json (quantization/export_metrics.py),
the eval split's baseline.json (data/baseline.py), export/samples.json (generation/samples_file.py),
pipeline.json (graphs/pipeline.py), the training folder's STOPPED and FINISHED (training/run_folder.py)
and a rank's heartbeat (training/comm.py), each read in one place, a missing or mistyped field refused
in one line naming the file and the key, and written back as the same JSON."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import export_metrics, model_description, train_summary
from ortflow import config as config_mod
from ortflow.checkpoints import manifest as checkpoint_manifest
from ortflow.checkpoints.layout import Listed, Manifest, ShardEntry
from ortflow.checkpoints.meta import META, Chosen, Merged, read_merged, write_merged
from ortflow.checkpoints.ort_format import CheckpointError
from ortflow.data import baseline
from ortflow.data.manifest import MANIFEST, Column, read_manifest, write_manifest
from ortflow.data.sources import DataError
from ortflow.errors import MissingInputError, ModelError, TrainingError
from ortflow.generation.samples_file import Sample, Samples, read_samples, write_samples_file
from ortflow.graphs.description import read_description, write_description
from ortflow.graphs.pipeline import Plan, Stage, read_plan, write_plan
from ortflow.quantization.export_metrics import read_export_metrics, write_export_metrics
from ortflow.stages.prepare_data import prepare
from ortflow.training import run_folder
from ortflow.training.comm import Beat, read_beat, write_beat
from ortflow.training.run_summary import BestEval, read_run_summary, write_run_summary


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The train split of a small classification data set, as prepare_data wrote it."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    np.savez(root / "toy.npz", x=rng.normal(size=(40, 3)).astype(np.float32), y=np.arange(40) % 4)
    prepare(config_mod.load(overrides={"data": {"source": str(root / "toy.npz")}}), root / "train", root / "eval")
    return root / "train"


def edited(split, tmp_path, change) -> object:
    """The manifest of `split` after `change(data)`, read from a copy in `tmp_path`."""
    data = json.loads((split / MANIFEST).read_text())
    change(data)
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    return read_manifest(tmp_path)


def test_the_manifest_is_read_as_written(split, tmp_path):
    manifest = read_manifest(split)
    assert (manifest.features, manifest.label) == ((Column("x", "float32", (3,)),), Column("y", "int64", ()))
    assert (manifest.task, manifest.num_classes, manifest.records, manifest.classes) == ("classification", 4, 32, None)
    assert sum(shard.records for shard in manifest.shards) == 32
    write_manifest(tmp_path, manifest)
    assert (tmp_path / MANIFEST).read_text() == (split / MANIFEST).read_text()


def test_a_manifest_missing_or_mistyping_a_field_names_the_file_and_the_key(split, tmp_path):
    path = tmp_path / MANIFEST
    with pytest.raises(DataError, match=rf"^{path}: no 'label.shape'; run the prepare_data rule again$"):
        edited(split, tmp_path, lambda data: data["label"].pop("shape"))
    with pytest.raises(DataError, match=rf"^{path}: no 'task'; run the prepare_data rule again$"):
        edited(split, tmp_path, lambda data: data.pop("task"))
    with pytest.raises(DataError, match=rf"^{path}: 'shards\[0\].records' is \"8\", expected an integer; run the "):
        edited(split, tmp_path, lambda data: data["shards"][0].update(records="8"))
    with pytest.raises(DataError, match=rf"^{path}: 'features' is {{}}, expected a list; "):
        edited(split, tmp_path, lambda data: data.update(features={}))
    with pytest.raises(DataError, match=rf"^{path}: not JSON \("):
        path.write_text("{")
        read_manifest(tmp_path)
    with pytest.raises(DataError, match=rf"^{path}: format 'other/2', expected 'ortflow-shards/1'$"):
        edited(split, tmp_path, lambda data: data.update(format="other/2"))


def test_a_manifest_of_an_earlier_ortflow_without_the_later_fields_is_read(split, tmp_path):
    """Runs prepared before data.standardize, string classes and data.tokenizer have none of their keys."""
    manifest = edited(split, tmp_path, lambda data: [data.pop(key) for key in ("standardize", "classes", "tokenizer")])
    assert (manifest.standardize, manifest.classes, manifest.tokenizer) == ({}, None, None)


def test_the_model_description_is_written_as_before_and_a_missing_key_is_named(tmp_path):
    """model.json: its keys in build_artifacts' order, the optional ones left out when absent; a
    description missing or mistyping a field is refused naming the file and the key."""
    path = tmp_path / "model.json"
    write_description(path, model_description(lora={"r": 8}))
    data = json.loads(path.read_text())
    assert list(data)[:12] == ["kind", "task", "loss", "num_classes", "inputs", "label", "outputs", "parameters",
                               "trainable_parameters", "trainable", "frozen", "embeddings"]
    assert list(data)[12:] == ["flops_per_sample", "activation_bytes_per_sample", "eval_bytes_per_sample",
                               "running_stats", "bf16_matmuls", "lora"]  # no recompute_blocks, no transformers
    assert read_description(path) == model_description(lora={"r": 8})
    for change, message in ((lambda d: d["outputs"].pop("logits"), "no 'outputs.logits'"),
                            (lambda d: d.update(parameters=1.5), "'parameters' is 1.5, expected an integer"),
                            (lambda d: d["inputs"][0].update(name=None), "'inputs\\[0\\].name' is null, expected a string")):
        edited_data = json.loads(json.dumps(data))
        change(edited_data)
        path.write_text(json.dumps(edited_data))
        with pytest.raises(ModelError, match=rf"^{path}: {message}; run the build_artifacts rule again$"):
            read_description(path)
    with pytest.raises(MissingInputError, match=rf"^{tmp_path / 'none.json'}: no model description"):
        read_description(tmp_path / "none.json")


def test_a_model_description_of_an_earlier_ortflow_reads_with_the_later_fields_absent(tmp_path):
    data = json.loads(json.dumps(dataclasses.asdict(model_description())))
    for key in ("embeddings", "eval_bytes_per_sample", "running_stats", "bf16_matmuls"):
        del data[key]
    del data["outputs"]["inference"]
    (tmp_path / "model.json").write_text(json.dumps(data))
    description = read_description(tmp_path / "model.json")
    assert (description.embeddings, description.eval_bytes_per_sample, description.running_stats) == (None, 0, {})
    assert description.inference_output == "logits"  # the logits', before the inference output was told apart


def rewritten(path, read, write) -> str:
    """The text of `path` after `write` wrote back what `read` read of it."""
    write(read())
    return path.read_text()


CHECKPOINT = Manifest("40-abc", 40, 2, {"optimizer": {"name": "adamw"}}, "d" * 64, {"lr": 0.001, "step": 40},
                      (ShardEntry("shard-00000-of-00002.h5", 100, "a" * 64, {"b": [0, 3], "w": [0, 5]}),
                       ShardEntry("shard-00001-of-00002.h5", 90, "b" * 64, {"w": [5, 12]})),
                      Listed("history.json", 30, "c" * 64))


def test_a_checkpoint_manifest_is_written_back_as_it_was_read(tmp_path):
    path = tmp_path / "manifest.json"
    checkpoint_manifest.write_manifest(path, CHECKPOINT)
    written = path.read_text()
    assert json.loads(written)["shards"][1] == {"file": "shard-00001-of-00002.h5", "bytes": 90, "sha256": "b" * 64,
                                                "parameters": {"w": [5, 12]}}
    assert checkpoint_manifest.read_manifest(path) == CHECKPOINT
    assert rewritten(path, lambda: checkpoint_manifest.read_manifest(path),
                     lambda m: checkpoint_manifest.write_manifest(path, m)) == written
    # A checkpoint saved before the history was kept has no entry of it, and none is added.
    checkpoint_manifest.write_manifest(path, dataclasses.replace(CHECKPOINT, history=None))
    assert "history" not in json.loads(path.read_text())
    assert checkpoint_manifest.read_manifest(path).history is None


def test_a_checkpoint_manifest_missing_or_mistyping_a_field_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "manifest.json"
    for change, message in ((lambda d: d["shards"][1].pop("sha256"), "no 'shards\\[1\\].sha256'"),
                            (lambda d: d.update(step="40"), "'step' is \"40\", expected an integer"),
                            (lambda d: d["history"].update(bytes=None), "'history.bytes' is null, expected an integer")):
        data = json.loads(json.dumps(dataclasses.asdict(CHECKPOINT)))
        change(data)
        path.write_text(json.dumps(data))
        with pytest.raises(CheckpointError, match=rf"^{path}: {message}; the file is damaged$"):
            checkpoint_manifest.read_manifest(path)


def test_a_merged_checkpoints_meta_is_written_back_as_it_was_read_and_says_which_it_is(tmp_path):
    best = Merged("40-abc", 40, 2, {"seed": 0}, "d" * 64, {"step": 40}, "/runs/step-00000040",
                  Chosen("best", "loss", "min", 0.123456789))
    write_merged(tmp_path, best)
    written = (tmp_path / META).read_text()
    assert json.loads(written)["chosen"] == {"checkpoint": "best", "metric": "loss", "mode": "min", "value": 0.123456789}
    assert read_merged(tmp_path) == best and read_merged(tmp_path).chosen.shown() == "best (eval loss 0.123457)"
    assert rewritten(tmp_path / META, lambda: read_merged(tmp_path), lambda m: write_merged(tmp_path, m)) == written
    write_merged(tmp_path, dataclasses.replace(best, chosen=Chosen("last")))
    assert json.loads((tmp_path / META).read_text())["chosen"] == {"checkpoint": "last"}
    # Merged before export.checkpoint: no `chosen`, the last checkpoint.
    data = json.loads((tmp_path / META).read_text())
    del data["chosen"]
    (tmp_path / META).write_text(json.dumps(data))
    assert read_merged(tmp_path).chosen.shown() == "last"
    (tmp_path / META).write_text(json.dumps({**data, "step": 4.5}))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / META}: 'step' is 4.5, expected an integer; run the "
                                              "merge_checkpoint rule again$"):
        read_merged(tmp_path)
    with pytest.raises(MissingInputError, match="no merged checkpoint \\(run the merge_checkpoint rule first\\)"):
        read_merged(tmp_path / "none")


def test_a_runs_summary_is_written_back_as_it_was_read_and_null_where_there_is_no_measure(tmp_path):
    """train/metrics.json: its keys in the trainer's order, a NaN (an attempt that ran no step) as null,
    no pipeline entries unless pipelined; a file missing a later key or mistyping one."""
    path = tmp_path / "metrics.json"
    summary = train_summary(samples_per_s=float("nan"), best=BestEval(40, "loss", "min", 0.25),
                            baseline={"of": "the train split's mean", "loss": 1.5})
    write_run_summary(path, summary)
    written = path.read_text()
    data = json.loads(written)
    assert list(data)[:3] == ["steps", "steps_this_attempt", "train_loss"] and "pipeline_bubble" not in data
    assert data["samples_per_s"] is None and data["best"] == {"step": 40, "metric": "loss", "mode": "min", "value": 0.25}
    read = read_run_summary(path)
    assert read == dataclasses.replace(summary, samples_per_s=None)
    assert rewritten(path, lambda: read_run_summary(path), lambda s: write_run_summary(path, s)) == written
    for key in ("steps_this_attempt", "best", "stopped_early", "baseline", "parameters", "trainable_parameters"):
        del data[key]  # a run of an earlier ortflow
    path.write_text(json.dumps(data))
    assert (read_run_summary(path).steps_this_attempt, read_run_summary(path).best) == (None, None)
    for change, message in ((lambda d: d.pop("history"), "no 'history'"),
                            (lambda d: d.update(peak_rss_mb=[300.0, "x"]), "'peak_rss_mb\\[1\\]' is \"x\", expected a number")):
        edited_data = json.loads(json.dumps(data))
        change(edited_data)
        path.write_text(json.dumps(edited_data))
        with pytest.raises(TrainingError, match=rf"^{path}: {message}; run the train rule again$"):
            read_run_summary(path)


def test_export_metrics_are_written_back_as_they_were_read_without_the_entries_a_run_has_not(tmp_path):
    path = tmp_path / "metrics.json"
    latency = {"b1_p50": 0.02, "b1_p95": 0.03, "b64_p50": 0.04, "b64_p95": 0.05}
    gate = {"metric": "accuracy", "drop": 3.57, "unit": "points", "max_accuracy_drop": 1, "outcome": "refused"}
    metrics = export_metrics({"loss": 0.2, "accuracy": 0.95, "per_class": {"a": {"count": 3}}, "latency_ms": latency,
                              "size_bytes": 4000}, {"loss": 0.3, "latency_ms": latency, "size_bytes": 1000}, gate)
    write_export_metrics(path, metrics)
    written = path.read_text()
    assert list(json.loads(written)) == ["quantize", "per_channel", "threads", "warnings", "fp32", "int8", "gate"]
    assert '"max_accuracy_drop": 1,' in written  # as the config gave it, not 1.0
    assert read_export_metrics(path) == metrics
    assert rewritten(path, lambda: read_export_metrics(path), lambda m: write_export_metrics(path, m)) == written
    fp32_only = dataclasses.replace(metrics, quantize="none", int8=None, gate=None)
    write_export_metrics(path, fp32_only)
    assert list(json.loads(path.read_text())) == ["quantize", "per_channel", "threads", "warnings", "fp32"]
    data = json.loads(written)
    del data["gate"]["outcome"], data["warnings"]  # before a refusal was kept, and before warnings
    path.write_text(json.dumps(data))
    assert (read_export_metrics(path).gate.outcome, read_export_metrics(path).warnings) == (None, ())
    path.write_text(json.dumps({**data, "int4": {"settings": {}, "gate": gate}}))
    with pytest.raises(ModelError, match=rf"^{path}: no 'int4.weights_quantized'; run the quantize_model rule again$"):
        read_export_metrics(path)


def refused(path, data, change, read, error, message):
    """`read()` of `data` after `change(data)`, written to `path`, raises `error` with `message`."""
    data = json.loads(json.dumps(data))
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(error, match=message):
        read()


def test_a_baseline_is_written_back_as_it_was_read_with_its_tasks_measures_only(tmp_path):
    path = tmp_path / baseline.BASELINE
    for scored, written in ((baseline.Baseline("the train split's most frequent class (1)", accuracy=None),
                             '{\n  "of": "the train split\'s most frequent class (1)",\n  "accuracy": null\n}\n'),
                            (baseline.Baseline("the train split's mean", mse=2.5, r2=None),
                             '{\n  "of": "the train split\'s mean",\n  "mse": 2.5,\n  "r2": null\n}\n'),
                            (baseline.Baseline("the train split's token frequencies", perplexity=7.5),
                             '{\n  "of": "the train split\'s token frequencies",\n  "perplexity": 7.5\n}\n')):
        baseline.write(tmp_path, scored)
        assert path.read_text() == written
        assert baseline.read(tmp_path) == scored
        assert rewritten(path, lambda: baseline.read(tmp_path), lambda b: baseline.write(tmp_path, b)) == written
    assert baseline.read(tmp_path / "older") is None  # data prepared before baselines
    data = {"of": "the train split's mean", "mse": 2.5, "r2": 0.5}
    for change, message in ((lambda d: d.pop("of"), "no 'of'"),
                            (lambda d: d.update(mse="2.5"), "'mse' is \"2.5\", expected a number")):
        refused(path, data, change, lambda: baseline.read(tmp_path), DataError,
                rf"^{path}: {message}; run the prepare_data rule again$")


def test_generated_samples_are_written_back_as_they_were_read(tmp_path):
    """export/samples.json: indented by one, the text as it is (not \\u escapes)."""
    path = tmp_path / "samples.json"
    samples = Samples(8, True, (Sample("<|user|>héllo", "wörld", "\u0003\u0003", "fine"),))
    write_samples_file(path, samples)
    written = path.read_text()
    assert written.startswith('{\n "max_new_tokens": 8,\n "greedy": true,\n "samples": [\n  {\n   "prompt": "<|user|>héllo"')
    assert read_samples(path) == samples
    assert rewritten(path, lambda: read_samples(path), lambda s: write_samples_file(path, s)) == written
    data = json.loads(written)
    for change, message in ((lambda d: d["samples"][0].pop("after"), "no 'samples\\[0\\].after'"),
                            (lambda d: d.update(greedy="yes"), "'greedy' is \"yes\", expected true or false")):
        refused(path, data, change, lambda: read_samples(path), ModelError,
                rf"^{path}: {message}; run the export_model rule again$")
    with pytest.raises(MissingInputError, match="no generated samples \\(run the export_model rule first\\)"):
        read_samples(tmp_path / "none.json")


PLAN = Plan("parameters", (16, 8), {"w": [0, 1]}, {"batch": ("x", 0)},
            (Stage(0, None, "h", ("batch", 4), ("x",), ("w", "w1"), 0, 20, model=object()),
             Stage(1, "h", "y", ("batch", 2), (), ("w", "w2"), 1, 12, model=object())))


def test_a_pipeline_plan_is_written_back_as_it_was_read_without_its_stages_models(tmp_path):
    path = tmp_path / "pipeline.json"
    write_plan(path, PLAN)
    written = path.read_text()
    data = json.loads(written)
    assert list(data) == ["balance", "costs", "tied", "symbols", "stages"] and data["symbols"] == {"batch": ["x", 0]}
    assert list(data["stages"][0]) == ["index", "input", "output", "output_shape", "features", "parameters",
                                       "dropouts_before", "held"]  # no model
    plan = read_plan(path)
    assert plan.stages == PLAN.stages and plan.stages[0].model is None and plan.stages[0].output_shape == ("batch", 4)
    assert rewritten(path, lambda: read_plan(path), lambda p: write_plan(path, p)) == written
    for stage in data["stages"]:
        del stage["held"]  # a pipeline.json written before the stages' elements were counted
    path.write_text(json.dumps(data))
    assert [stage.held for stage in read_plan(path).stages] == [None, None]
    for change, message in ((lambda d: d["stages"][1].pop("output"), "no 'stages\\[1\\].output'"),
                            (lambda d: d["stages"][0]["output_shape"].append(1.5),
                             "'stages\\[0\\].output_shape\\[2\\]' is 1.5, expected an integer or a string"),
                            (lambda d: d.update(tied=[]), "'tied' is \\[\\], expected an object")):
        refused(path, data, change, lambda: read_plan(path), ModelError,
                rf"^{path}: {message}; run the build_artifacts rule again$")


def test_the_attempt_files_and_a_heartbeat_are_written_back_as_they_were_read(tmp_path):
    """STOPPED and a heartbeat without a newline, FINISHED with one, none of them indented."""
    folder = run_folder.TrainFolder(tmp_path)
    assert (run_folder.read_stopped(folder), run_folder.read_finished(folder)) == (None, None)
    run_folder.write_stopped(folder, run_folder.AttemptStopped("SIGTERM", 26))
    run_folder.write_finished(folder, run_folder.AttemptFinished(30))
    write_beat(tmp_path / "rank-1.json", Beat(29, "checkpoint", 1795792671.562295))
    assert folder.stopped.read_text() == '{"signal": "SIGTERM", "step": 26}'
    assert folder.finished.read_text() == '{"steps": 30}\n'
    assert (tmp_path / "rank-1.json").read_text() == '{"step": 29, "phase": "checkpoint", "time": 1795792671.562295}'
    assert run_folder.read_stopped(folder) == run_folder.AttemptStopped("SIGTERM", 26)
    assert run_folder.read_finished(folder).steps == 30
    assert read_beat(tmp_path / "rank-1.json") == Beat(29, "checkpoint", 1795792671.562295)
    remedy = "delete it and rerun the train rule"
    refused(folder.stopped, {"signal": "SIGTERM", "step": 26}, lambda d: d.update(step="26"),
            lambda: run_folder.read_stopped(folder), TrainingError,
            rf"^{folder.stopped}: 'step' is \"26\", expected an integer; {remedy}$")
    refused(folder.finished, {"steps": 30}, lambda d: d.pop("steps"), lambda: run_folder.read_finished(folder),
            TrainingError, rf"^{folder.finished}: no 'steps'; {remedy}$")
    refused(tmp_path / "rank-1.json", {"step": 29, "phase": "checkpoint", "time": 1.0}, lambda d: d.pop("phase"),
            lambda: read_beat(tmp_path / "rank-1.json"), TrainingError,
            rf"^{tmp_path / 'rank-1.json'}: no 'phase'; each rank rewrites its own at every step$")
