"""Seeing a run: a short run of its own config file with profiling, its Snakemake
report made by the command the run printed and opened in a real headless
Chromium (tests/chromium.py), the end-of-run summary, and the profiler's traces."""

from __future__ import annotations

import base64
import csv
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from chromium import Chromium
from conftest import export_metrics, fault, model_description, run_snakemake, train_summary
from ortflow.graphs.description import write_description
from ortflow.quantization.export_metrics import Gate, read_export_metrics, write_export_metrics
from ortflow.reporting.results import fmt, quality, speedup
from ortflow.reporting.summary import run_summary
from ortflow.reporting.tables import summary_rows
from ortflow.training.comm import read_beat
from ortflow.training.run_folder import TrainFolder
from ortflow.training.run_summary import read_run_summary, write_run_summary

# A run other than the default one: its own run.name, from its own --configfile.
RUN = "seen"
CONFIG = {"run": {"name": RUN}, "train": {"steps": 60, "profile_steps": [10, 12]}}


def printed_report_command(stdout: str) -> str:
    """The command of the summary's `report` line."""
    (command,) = [line.split(None, 1)[1] for line in stdout.splitlines() if line.startswith("  report ")]
    return command


@pytest.fixture(scope="module")
def report_run(tmp_path_factory) -> tuple[Path, str]:
    """The run, 60 steps, steps 10 to 12 profiled, and its report, made by the
    report command its summary printed, run as printed; and the run's stdout."""
    workdir = tmp_path_factory.mktemp("report") / "work"
    result = run_snakemake(workdir, CONFIG)
    command = printed_report_command(result.stdout)
    report = subprocess.run(shlex.split(command), cwd=workdir, capture_output=True, text=True, timeout=600)
    if report.returncode != 0:
        pytest.fail(f"the printed report command failed ({report.returncode}): {command}\n{report.stderr[-4000:]}")
    return workdir, result.stdout


@pytest.mark.e2e
def test_the_printed_report_command_writes_this_runs_report(report_run):
    workdir, stdout = report_run
    command = shlex.split(printed_report_command(stdout))
    assert command[:3] == ["snakemake", "--report", f"results/{RUN}/report.html"]
    assert command[command.index("--configfile") + 1] == "test-config.yaml"
    page = (workdir / "results" / RUN / "report.html").read_text()
    # The report's own copy of this run's summary table, titled with the run's name.
    summary = re.search(r"filename=summary\.html;base64,([A-Za-z0-9+/=]+)", page).group(1)
    assert f"<title>Run {RUN}</title>" in base64.b64decode(summary).decode()


@pytest.mark.e2e
def test_report_in_chromium_shows_plots_and_the_numbers_of_the_metrics(report_run, tmp_path):
    workdir, _ = report_run
    results = workdir / "results" / RUN
    train = json.loads((results / "train" / "metrics.json").read_text())
    export = json.loads((results / "export" / "metrics.json").read_text())
    browser = Chromium(tmp_path / "chromium-profile")
    try:
        browser.open((results / "report.html").as_uri())
        paths = browser.wait_for("typeof app !== 'undefined' && app.state && Object.keys(results)",
                                 "its results")
        report_files = {Path(p).name: p for p in paths}
        assert set(report_files) == {"loss.png", "learning_rate.png", "throughput.png", "summary.html",
                                     "samples.html", "quantization.html", "config.html", "stages.html",
                                     "profile.html"}

        # Each plot as the report's eye button shows it: an <img> that decodes to a drawn figure.
        for name in ("loss.png", "learning_rate.png", "throughput.png"):
            path = json.dumps(report_files[name])
            browser.evaluate(f"app.setView({{content: 'img', contentPath: results[{path}].data_uri, "
                             f"resultPath: {path}}})")
            width, height, shown, inked = browser.wait_for(
                f"""(() => {{
                    const img = [...document.images].find(i => i.src === results[{path}].data_uri);
                    if (!img || !img.complete || !img.naturalWidth) return null;
                    const canvas = document.createElement('canvas');
                    canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
                    const context = canvas.getContext('2d');
                    context.drawImage(img, 0, 0);
                    const pixels = context.getImageData(0, 0, canvas.width, canvas.height).data;
                    let inked = 0;
                    for (let i = 0; i < pixels.length; i += 4) if (pixels[i] + pixels[i + 1] + pixels[i + 2] < 600) inked++;
                    return [img.naturalWidth, img.naturalHeight, img.getBoundingClientRect().width, inked / (pixels.length / 4)];
                }})()""", name)
            assert width >= 500 and height >= 300 and shown > 0, (name, width, height, shown)
            assert 0.01 < inked < 0.5, f"{name}: {inked:.3f} of the pixels drawn: blank or solid"

        def table(name: str) -> dict[str, list[str]]:
            path = json.dumps(report_files[name])
            browser.evaluate(f"app.setView({{content: 'html', contentPath: results[{path}].data_uri, "
                             f"resultPath: {path}}})")
            return browser.frame_rows()

        summary = table("summary.html")
        assert summary["fp32"][1] == fmt(export["fp32"]["accuracy"], "percent")
        assert summary["int8"][1] == fmt(export["int8"]["accuracy"], "percent")
        assert summary["speedup"][1] == fmt(
            export["fp32"]["latency_ms"]["b64_p50"] / export["int8"]["latency_ms"]["b64_p50"], "ratio")
        assert summary["steps"][1] == "60"
        assert summary["wall_time_s"][1] == fmt(train["wall_time_s"], "seconds")
        assert summary["samples_per_s"][1] == fmt(train["samples_per_s"], "rate")

        quantization = table("quantization.html")
        assert quantization["accuracy"][1:] == [fmt(export[m]["accuracy"], "percent") for m in ("fp32", "int8")]
        assert quantization["latency_ms.b64_p50"][1:] == [
            fmt(export[m]["latency_ms"]["b64_p50"], "ms") for m in ("fp32", "int8")]

        # the digits' MLP generates nothing: its samples page says why
        assert "No generated samples: this run has no <code>export/generation/</code> folder" in \
            (results / "report" / "samples.html").read_text()

        stages = table("stages.html")
        assert list(stages) == ["prepare_data", "build_artifacts", "train", "merge_checkpoint",
                                "export_model", "quantize_model"]
        with open(results / "benchmarks" / "train.tsv") as file:
            assert stages["train"][1] == fmt(float(next(csv.DictReader(file, delimiter="\t"))["s"]), "seconds")

        operators = table("profile.html")
        assert "FusedGemm" in operators or "Gemm" in operators, operators
        # Shares are rounded to 0.01%: each row is off by at most 0.005 points.
        shares = [float(cells[3].rstrip("%")) for cells in operators.values()]
        assert sum(shares) <= 100 + 0.005 * len(shares) + 1e-9
    finally:
        browser.close()


@pytest.mark.e2e
def test_after_some_stages_the_printed_report_command_works(workdir):
    """`snakemake --report` refuses to start while a file marked for the report does
    not exist (loss.png, after `snakemake merge_checkpoint`): the printed command
    reports on the stages this run was asked for."""
    result = run_snakemake(workdir, {"run": {"name": "partial"}}, "prepare_data")
    command = shlex.split(printed_report_command(result.stdout))
    assert command[:4] == ["snakemake", "--report", "results/partial/report.html", "prepare_data"]
    report = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "<title>Snakemake Report</title>" in (workdir / "results/partial/report.html").read_text()


@pytest.mark.e2e
def test_profile_traces_cover_the_profiled_steps_on_every_rank(report_run):
    workdir, _ = report_run
    profile = workdir / "results" / RUN / "train" / "profile"
    for rank in (0, 1):
        (train_trace,) = profile.glob(f"rank{rank}-step10-train_*.json")
        (optimizer_trace,) = profile.glob(f"rank{rank}-step10-optimizer_*.json")
        events = json.loads(train_trace.read_text())
        # Steps 10, 11 and 12: three runs of the training graph, with its operators' kernel times.
        assert sum(e["name"] == "model_run" for e in events) == 3
        assert any(e.get("cat") == "Node" and e["name"].endswith("_kernel_time") for e in events)
        assert sum(e["name"] == "model_run" for e in json.loads(optimizer_trace.read_text())) == 3


@pytest.mark.e2e
def test_end_of_run_summary_is_printed_and_copes_with_a_partial_run(report_run, tmp_path):
    workdir, stdout = report_run
    results = workdir / "results" / RUN
    export = json.loads((results / "export" / "metrics.json").read_text())
    train = json.loads((results / "train" / "metrics.json").read_text())
    assert f"results/{RUN}/export/model.onnx" in stdout
    assert f"accuracy  {fmt(export['fp32']['accuracy'], 'percent')}, int8 " \
           f"{fmt(export['int8']['accuracy'], 'percent')}, int8 speed-up " \
           f"{fmt(speedup(read_export_metrics(results / 'export' / 'metrics.json')), 'ratio')}" in stdout
    assert f"60 steps (60 in this attempt) in {fmt(train['wall_time_s'], 'seconds')}" in stdout

    # Training alone has run: its eval and its speed, no model.
    partial = tmp_path / "results" / "digits"
    (partial / "train").mkdir(parents=True)
    shutil.copy(results / "train" / "metrics.json", partial / "train" / "metrics.json")
    lines = run_summary(partial, **files_of(partial))
    assert "model " not in lines
    assert f"{quality(train['eval'])[1]} (eval at step 60)" in lines
    nothing = tmp_path / "nothing"
    assert "nothing trained yet" in run_summary(nothing, **files_of(nothing))


def files_of(results: Path) -> dict:
    """The files run_summary reads, where the rules write them under `results`."""
    return {"train_metrics": results / "train/metrics.json", "export_metrics": results / "export/metrics.json",
            "model": results / "export/model.onnx", "int8": results / "export/model.int8.onnx",
            "checkpoint": results / "checkpoint", "report": results / "report.html"}


def test_summary_of_a_run_with_training_alone_or_nothing(tmp_path):
    """The end-of-run summary from what exists, without a run: training's metrics alone
    show its eval, steps and speed and no model; an empty folder, that nothing trained."""
    partial = tmp_path / "results" / "digits"
    (partial / "train").mkdir(parents=True)
    train = train_summary(steps_this_attempt=20, peak_rss_mb=(300.0, 310.0), eval={"loss": 0.25, "accuracy": 0.9375})
    write_run_summary(partial / "train" / "metrics.json", train)
    lines = run_summary(partial, **files_of(partial)).splitlines()
    assert lines[:3] == [f"ortflow: run digits in {partial}", "  accuracy  93.75% (eval at step 60)",
                         "  training  60 steps (20 in this attempt) in 12.50 s, 1,536 samples/s on 2 ranks"]
    nothing = tmp_path / "nothing"
    assert run_summary(nothing, **files_of(nothing)).splitlines()[1] == "  nothing trained yet"
    # One rank, not "1 ranks".
    write_run_summary(partial / "train" / "metrics.json", dataclasses.replace(train, peak_rss_mb=(300.0,)))
    assert run_summary(partial, **files_of(partial)).splitlines()[2].endswith(" samples/s on 1 rank")


def test_summary_and_report_say_what_lora_trained(tmp_path):
    """With model.lora, build_artifacts' model.json gives the end-of-run summary's line and the
    report's rows: the adapters, and the parameters trained against all."""
    run = tmp_path / "results" / "lora"
    (run / "artifacts").mkdir(parents=True)
    # Before build_artifacts (the doctor target alone), no model.json: no line of it.
    assert "  trained   " not in run_summary(run, **files_of(run), artifacts=run / "artifacts")
    description = model_description(parameters=4_400_000, trainable_parameters=294_912,
                                    lora={"r": 8, "alpha": 16, "dropout": 0.05, "targets": ["q_proj", "v_proj"]})
    write_description(run / "artifacts" / "model.json", description)
    lines = run_summary(run, **files_of(run), artifacts=run / "artifacts").splitlines()
    assert "  trained   LoRA r=8 on q_proj,v_proj: 0.29M of 4.40M parameters trained (6.70%)" in lines
    rows = summary_rows(None, None, description)
    assert ("trainable_parameters", "parameters trained", "0.29M of 4.40M (6.70%)") in rows
    assert ("lora", "LoRA adapters", "r=8, alpha=16, dropout=0.05 on q_proj, v_proj") in rows
    assert [row[0] for row in summary_rows(None, None, dataclasses.replace(description, lora=None))] == ["trainable_parameters"]


def test_summary_shows_the_baseline_and_says_when_the_model_does_not_beat_it(tmp_path):
    run = tmp_path / "results" / "digits"
    (run / "train").mkdir(parents=True)
    train = train_summary(steps_this_attempt=60, eval={"loss": 2.25, "accuracy": 0.09},
                          baseline={"of": "the train split's most frequent class (1)", "accuracy": 0.1})
    write_run_summary(run / "train" / "metrics.json", train)
    lines = run_summary(run, **files_of(run)).splitlines()
    assert lines[1:5] == [
        "  accuracy  9.00% (eval at step 60)",
        "  baseline  accuracy 10.00% (predicting the train split's most frequent class (1))",
        "  training  60 steps (60 in this attempt) in 12.50 s, 1,536 samples/s on 1 rank",
        "  warning   the model does not beat the baseline: eval accuracy 0.09 is not above 0.1, that of predicting "
        "the train split's most frequent class (1)"]
    rows = summary_rows(train, None)
    assert ("beats_baseline", "beats the baseline", "no") in rows
    better = dataclasses.replace(train, eval={"loss": 2.25, "accuracy": 0.5})
    assert ("beats_baseline", "beats the baseline", "yes") in summary_rows(better, None)


def test_summary_and_report_repeat_the_warnings_training_started_with(tmp_path):
    run = tmp_path / "results" / "digits"
    (run / "train").mkdir(parents=True)
    warning = ("precision: train.precision: bf16 on avx512_bf16, but bfloat16 products run at 0.55x float32's "
               "speed on this CPU (measured now): it trains slower than fp32 (fix: set train.precision: fp32)")
    write_run_summary(run / "train" / "metrics.json", train_summary(warnings=(warning,)))
    lines = run_summary(run, **files_of(run)).splitlines()
    assert lines[3] == f"  warning   {warning}"
    assert ("setup_warnings", "warnings before training", warning) in summary_rows(read_run_summary(
        run / "train" / "metrics.json"), None)


def test_summary_and_report_of_a_run_whose_int8_model_the_gate_refused(tmp_path):
    """The gate refused int8 (export/metrics.json): the summary and the report's table say so and by how
    much, and the int8 file, still on disk, is not offered as the model."""
    from ortflow.reporting.tables import summary_rows

    results = tmp_path / "results" / "digits"
    (results / "export").mkdir(parents=True)
    for name in ("model.onnx", "model.int8.onnx"):
        (results / "export" / name).write_bytes(b"onnx")
    latency = {"b1_p50": 0.02, "b1_p95": 0.03, "b64_p50": 0.04, "b64_p95": 0.05}
    export = export_metrics({"loss": 0.2, "accuracy": 0.95, "latency_ms": latency, "size_bytes": 4000},
                            {"loss": 0.3, "accuracy": 0.9143, "latency_ms": latency, "size_bytes": 1000},
                            {"metric": "accuracy", "drop": 3.57, "unit": "points", "max_accuracy_drop": 1.0,
                             "outcome": "refused"})
    write_export_metrics(results / "export" / "metrics.json", export)
    lines = run_summary(results, **files_of(results)).splitlines()
    assert lines[1:4] == [f"  model     {results}/export/model.onnx",
                          "  accuracy  95.00%, int8 91.43%, int8 speed-up 1.00x at batch 64",
                          "  int8      refused by the gate, -3.57 points (export.max_accuracy_drop: 1): "
                          "deploy the fp32 model"]
    assert ("gate", "int8", "refused by the gate, -3.57 points (export.max_accuracy_drop: 1)") in summary_rows(None, export)
    # A perplexity's drop is a relative increase; a gate that passed is not mentioned.
    gate = Gate("perplexity", 12.5, "%", 5.0, "refused")
    write_export_metrics(results / "export" / "metrics.json", dataclasses.replace(export, gate=gate))
    assert "  int8      refused by the gate, +12.5% perplexity (export.max_accuracy_drop: 5): deploy the fp32 model" \
        in run_summary(results, **files_of(results)).splitlines()
    passed = dataclasses.replace(export, gate=dataclasses.replace(gate, outcome="passed"))
    write_export_metrics(results / "export" / "metrics.json", passed)
    shown = run_summary(results, **files_of(results))
    assert "refused" not in shown and f"(int8: {results}/export/model.int8.onnx)" in shown


def test_summary_says_when_the_model_shown_was_exported_from_an_earlier_training(tmp_path):
    """`snakemake train` after a change of settings trains again but leaves the export: the model
    and figures shown are of the training before, and the summary says so with the command that
    exports this one (and not once the export is newer)."""
    results = tmp_path / "results" / "digits"
    (results / "train").mkdir(parents=True)
    (results / "export").mkdir()
    write_export_metrics(results / "export" / "metrics.json", export_metrics({"accuracy": 0.98, "size_bytes": 100}))
    write_run_summary(results / "train" / "metrics.json", train_summary())
    os.utime(results / "export" / "metrics.json", (1e9, 1e9))  # exported long before this training
    arguments = ["--config", "train={precision: bf16}"]
    lines = run_summary(results, **files_of(results), run_arguments=arguments).splitlines()
    assert ("  warning   the model and its figures above were exported from an earlier training; "
            "`snakemake --cores all --config 'train={precision: bf16}'` exports this one") in lines
    os.utime(results / "export" / "metrics.json")  # now: exported after it
    assert "earlier training" not in run_summary(results, **files_of(results), run_arguments=arguments)


def console_tail(stderr: str) -> list[str]:
    """What a failed `snakemake` printed last, after Snakemake's own "Exiting because a job execution failed"."""
    return stderr.split("Exiting because a job execution failed", 1)[1].splitlines()


@pytest.mark.e2e
def test_a_failed_stage_shows_its_own_error_last_on_the_console(workdir):
    workdir.mkdir(parents=True)
    (workdir / "my.csv").write_text("a,b,y\n1,2,0\n3,4,1\n")
    bad = {"run": {"name": "bad"}, "data": {"source": "my.csv", "features": ["a", "c"], "label": "y"}}
    result = run_snakemake(workdir, bad, "prepare_data", check=False)
    assert result.returncode != 0
    assert console_tail(result.stderr)[1:3] == [
        "ortflow: stage prepare_data failed; from logs/bad/prepare_data.log:",
        "  ortflow prepare-data: error: my.csv: column(s) c not found; the file has columns a, b, y "
        "(set data.features and data.label)",
    ]


@pytest.mark.e2e
def test_a_failed_rank_shows_its_error_above_the_launchers(digits_workdir):
    result = run_snakemake(digits_workdir, {"train": {"steps": 20}}, "train", check=False, env=fault(5, 1, "raise"))
    assert result.returncode != 0
    tail = console_tail(result.stderr)
    assert tail[1] == "ortflow: stage train failed; from logs/digits/train.log:"
    assert tail[2].endswith("[rank 1] ERROR rank 1 failed: injected failure on rank 1 at step 5 (ORTFLOW_FAULT)")
    assert tail[3].startswith("  ortflow train: error: the ranks exited with code ")


@pytest.mark.e2e
def test_a_failed_stage_shows_the_whole_of_a_multi_line_error(digits_workdir):
    """A message of several problems, each with its fix (preflight), not only its first line."""
    result = run_snakemake(digits_workdir, {"train": {"world_size": 9}}, "train", check=False)
    assert result.returncode != 0
    tail = console_tail(result.stderr)
    assert tail[1:3] == ["ortflow: stage train failed; from logs/digits/train.log:",
                         "  ortflow train: error: cannot start training:"]
    assert tail[3].startswith("    - world size: train.world_size=9 ranks cannot run on this host's "), tail
    assert tail[4].startswith("      fix: set train.world_size to at most "), tail


def rank_process(workdir: Path, rank: int):
    """The process of MPI rank `rank` training in `workdir` (other tests may be training too)."""
    import psutil

    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if "ortflow.training.trainer" in (process.info["cmdline"] or []) and process.info["cwd"] == str(workdir) \
                    and process.environ().get("OMPI_COMM_WORLD_RANK") == str(rank):
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.e2e
def test_a_rank_killed_by_a_signal_is_named_with_the_signal(digits_workdir):
    """A rank killed by SIGKILL (as the out-of-memory killer does) writes no error of its
    own: mpirun's notice, wrapped over two lines of its log, says which and of what."""
    stall = {"train": {"steps": 20, "collective_timeout_s": 600}}
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run=run_snakemake(
        digits_workdir, stall, "train", check=False, env=fault(3, 1, "stall"))))
    runner.start()
    heartbeat = TrainFolder(digits_workdir / "results/digits/train").heartbeat / "rank-1.json"

    def at_step_3() -> bool:
        return heartbeat.exists() and read_beat(heartbeat).step == 3

    deadline = time.monotonic() + 240
    while not at_step_3() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert at_step_3(), "rank 1 never reached step 3"
    rank_process(digits_workdir, 1).kill()
    runner.join(timeout=240)
    tail = console_tail(result["run"].stderr)
    assert tail[1] == "ortflow: stage train failed; from logs/digits/train.log:"
    assert re.fullmatch(r"  prterun noticed that process rank 1 with PID \d+ on node \S+ exited on signal 9 "
                        r"\(Killed\)\.", tail[2]), tail
    assert tail[3] == ("  ortflow train: error: the ranks exited with code 137: a rank was killed by SIGKILL (the "
                       "kernel's out-of-memory killer sends it: see `dmesg`); mpirun's message above names it"), tail
