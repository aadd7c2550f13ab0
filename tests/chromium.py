"""A real headless Chromium for the tests that look at what a browser shows
(tests/test_report.py): Debian's `chromium` package, which the tests install
themselves when it is missing (apt-get, as root: as tests/slurm/setup.sh
installs Slurm), and a small client of its DevTools protocol."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

PACKAGE = "chromium"


def install() -> str:
    """Install Debian's chromium with apt-get and return its path; fail, saying
    what to do, where that is impossible (not root, no apt-get) or apt-get fails."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail(f"chromium is not installed, and only root on Debian can install it from here: "
                    f"run `apt-get install -y {PACKAGE}` as root, then the tests again")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", PACKAGE]):
        done = subprocess.run(command, capture_output=True, text=True, env=environment,
                              stdin=subprocess.DEVNULL, timeout=1200)
        if done.returncode != 0:
            pytest.fail(f"could not install chromium: `{' '.join(command)}` exited with "
                        f"{done.returncode}:\n{done.stderr[-3000:]}")
    return shutil.which("chromium") or pytest.fail(f"apt-get installed {PACKAGE} but no `chromium` is on PATH")


class Chromium:
    """Headless Chromium driven through the DevTools protocol over a pipe
    (`--remote-debugging-pipe`: it reads commands on fd 3, answers on fd 4)."""

    def __init__(self, user_data_dir: Path):
        binary = shutil.which("chromium") or install()
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
        so another origin: read in a world of its own), by key. The report may not have
        made the iframe yet, or it may still be navigating to the new page, which destroys a
        world made in the old one: then look again."""
        query = ("document.readyState === 'complete' && [...document.querySelectorAll('tr[data-key]')]"
                 ".map(r => [r.dataset.key, ...[...r.cells].map(c => c.innerText.trim())])")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            frames = self.send("Page.getFrameTree")["frameTree"].get("childFrames", [])
            assert len(frames) <= 1, f"expected the report to show one iframe, found {len(frames)}"
            if not frames:
                time.sleep(0.1)
                continue
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
