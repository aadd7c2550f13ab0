"""Seeing a run: a short default run with profiling, its Snakemake report opened
in a real headless Chromium (Debian's `chromium` package: `.ci/run` installs it),
the end-of-run summary, and the profiler's traces."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_snakemake
from ortflow.report import fmt, quality, run_summary, speedup

CONFIG = {"train": {"steps": 60, "profile_steps": [10, 12]}}


class Chromium:
    """Headless Chromium driven through the DevTools protocol over a pipe
    (`--remote-debugging-pipe`: it reads commands on fd 3, answers on fd 4)."""

    def __init__(self, user_data_dir: Path):
        binary = shutil.which("chromium")
        if binary is None:
            pytest.fail("chromium is not installed: `apt-get install -y chromium` (Debian), as .ci/run does")
        to_browser, from_browser = os.pipe(), os.pipe()
        # Above the fds the child gets, so that moving them to 3 and 4 clobbers nothing.
        child_in, child_out = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser[0], from_browser[1]))

        def pipes_to_3_and_4():
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={user_data_dir}",
             "--remote-debugging-pipe", "--window-size=1400,1000", "about:blank"],
            pass_fds=(3, 4), preexec_fn=pipes_to_3_and_4, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (to_browser[0], from_browser[1], child_in, child_out):
            os.close(fd)
        self.writer, self.reader = os.fdopen(to_browser[1], "wb"), os.fdopen(from_browser[0], "rb")
        self.next_id, self.session = 0, None

    def send(self, method: str, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        self.writer.write(json.dumps(message).encode() + b"\0")
        self.writer.flush()
        buffer = b""
        while True:  # events arrive between answers; skip them
            chunk = self.reader.read1(1 << 16)
            if not chunk:
                pytest.fail(f"chromium closed the DevTools pipe (exit code {self.process.poll()})")
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self.next_id:
                    assert "error" not in answer, f"{method}: {answer['error']}"
                    return answer["result"]

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", url=url)["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable")

    def evaluate(self, expression: str, context: int | None = None):
        params = {"expression": expression, "returnByValue": True, "awaitPromise": True}
        if context is not None:
            params["contextId"] = context
        result = self.send("Runtime.evaluate", **params)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, context: int | None = None, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression, context)
            if value:
                return value
            time.sleep(0.1)
        pytest.fail(f"the report did not show {what} within {timeout} s")

    def frame_rows(self, timeout: float = 30) -> dict[str, list[str]]:
        """The rows with a data-key of the HTML page shown in the report's iframe (a data: URL,
        so another origin: read in a world of its own), by key. The iframe may still be
        navigating to the new page, which destroys a world made in the old one: then make
        another."""
        query = ("document.readyState === 'complete' && [...document.querySelectorAll('tr[data-key]')]"
                 ".map(r => [r.dataset.key, ...[...r.cells].map(c => c.innerText.trim())])")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            frames = self.send("Page.getFrameTree")["frameTree"].get("childFrames", [])
            assert len(frames) == 1, f"expected the report to show one iframe, found {len(frames)}"
            context = self.send("Page.createIsolatedWorld", frameId=frames[0]["frame"]["id"])["executionContextId"]
            try:
                rows = self.evaluate(query, context)
            except AssertionError as error:
                if "Cannot find context" not in str(error):
                    raise
                rows = None
            if rows:
                return {key: cells for key, *cells in rows}
            time.sleep(0.1)
        pytest.fail(f"the report did not show a table within {timeout} s")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def report_run(tmp_path_factory, digits_inputs) -> tuple[Path, str]:
    """The default run, 60 steps, steps 10 to 12 profiled, and its report; and the run's stdout."""
    workdir = tmp_path_factory.mktemp("report") / "work"
    shutil.copytree(digits_inputs / "results", workdir / "results")
    shutil.copytree(digits_inputs / ".snakemake" / "metadata", workdir / ".snakemake" / "metadata")
    result = run_snakemake(workdir, CONFIG)
    run_snakemake(workdir, CONFIG, "--report", "results/digits/report.html")
    return workdir, result.stdout


def test_report_in_chromium_shows_plots_and_the_numbers_of_the_metrics(report_run, tmp_path):
    workdir, _ = report_run
    results = workdir / "results" / "digits"
    train = json.loads((results / "train" / "metrics.json").read_text())
    export = json.loads((results / "export" / "metrics.json").read_text())
    browser = Chromium(tmp_path / "chromium-profile")
    try:
        browser.open((results / "report.html").as_uri())
        paths = browser.wait_for("typeof app !== 'undefined' && app.state && Object.keys(results)",
                                 "its results")
        report_files = {Path(p).name: p for p in paths}
        assert set(report_files) == {"loss.png", "learning_rate.png", "throughput.png", "summary.html",
                                     "quantization.html", "config.html", "stages.html", "profile.html"}

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

        stages = table("stages.html")
        assert list(stages) == ["prepare_data", "build_artifacts", "train", "merge_checkpoint",
                                "export_model", "quantize_model"]
        with open(results / "benchmarks" / "train.tsv") as file:
            assert stages["train"][1] == fmt(float(next(csv.DictReader(file, delimiter="\t"))["s"]), "seconds")

        operators = table("profile.html")
        assert "FusedGemm" in operators or "Gemm" in operators, operators
        assert sum(float(cells[3].rstrip("%")) for cells in operators.values()) <= 100.01
    finally:
        browser.close()


def test_profile_traces_cover_the_profiled_steps_on_every_rank(report_run):
    workdir, _ = report_run
    profile = workdir / "results" / "digits" / "train" / "profile"
    for rank in (0, 1):
        (train_trace,) = profile.glob(f"rank{rank}-step10-train_*.json")
        (optimizer_trace,) = profile.glob(f"rank{rank}-step10-optimizer_*.json")
        events = json.loads(train_trace.read_text())
        # Steps 10, 11 and 12: three runs of the training graph, with its operators' kernel times.
        assert sum(e["name"] == "model_run" for e in events) == 3
        assert any(e.get("cat") == "Node" and e["name"].endswith("_kernel_time") for e in events)
        assert sum(e["name"] == "model_run" for e in json.loads(optimizer_trace.read_text())) == 3


def test_end_of_run_summary_is_printed_and_copes_with_a_partial_run(report_run, tmp_path):
    workdir, stdout = report_run
    results = workdir / "results" / "digits"
    export = json.loads((results / "export" / "metrics.json").read_text())
    train = json.loads((results / "train" / "metrics.json").read_text())
    assert "results/digits/export/model.onnx" in stdout
    assert f"accuracy  {fmt(export['fp32']['accuracy'], 'percent')}, int8 " \
           f"{fmt(export['int8']['accuracy'], 'percent')}, int8 speed-up {fmt(speedup(export), 'ratio')}" in stdout
    assert f"60 steps (60 in this attempt) in {fmt(train['wall_time_s'], 'seconds')}" in stdout

    # Training alone has run: its eval and its speed, no model.
    partial = tmp_path / "results" / "digits"
    (partial / "train").mkdir(parents=True)
    shutil.copy(results / "train" / "metrics.json", partial / "train" / "metrics.json")
    lines = run_summary(partial)
    assert "model " not in lines
    assert f"{quality(train['eval'])[1]} (eval at step 60)" in lines
    assert "nothing trained yet" in run_summary(tmp_path / "nothing")
