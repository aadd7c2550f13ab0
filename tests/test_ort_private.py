"""ONNX Runtime's private parts are reached in one module, fenced to the version
they were read from."""

from __future__ import annotations

import re
from pathlib import Path

import onnxruntime
import pytest

from ortflow import ort_private
from ortflow.errors import PreflightError

SRC = Path(__file__).resolve().parents[1] / "src" / "ortflow"
# What reaching into ONNX Runtime looks like: its C extension modules, the undocumented
# flatbuffer schema, onnxblock's internals, or the private attributes of its objects.
PRIVATE = re.compile(r"_pybind_state|pybind11_state|ort_flatbuffers_py|_graph_utils|_build_optimizer_node|"
                     r"\._state\b|\._ortvalue\b|\._adamw\b")


def test_only_ort_private_reaches_private_parts_of_onnxruntime():
    found = [f"{path.relative_to(SRC)}:{number}: {line.strip()}"
             for path in sorted(SRC.rglob("*.py")) if path.name != "ort_private.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert found == []
    assert PRIVATE.search((SRC / "ort_private.py").read_text())  # the pattern finds what it looks for


def test_another_onnxruntime_version_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
    ort_private.check_version.cache_clear()
    try:
        with pytest.raises(PreflightError) as error:
            ort_private.restart_node_names()
        monkeypatch.undo()
        ort_private.check_version.cache_clear()
        ort_private.check_version()  # the installed one passes
    finally:
        ort_private.check_version.cache_clear()
    assert str(error.value) == (
        "onnxruntime 1.20.1 is installed; ortflow reaches parts of ONNX Runtime that are not its public API, read "
        "from 1.19.2 (src/ortflow/ort_private.py): pip install onnxruntime-training==1.19.2")


def test_a_stage_process_reads_checkpoints_without_importing_torch_or_sympy():
    """skip_ortmodule (cli.py's and the ranks' first step) and checkpoint_schema spare a stage that
    needs neither (the merge, an MLP's export) the torch and sympy that onnxruntime's training
    package imports for ORTModule and for onnxruntime.tools."""
    import subprocess
    import sys

    code = ("import sys; from ortflow import ort_private; ort_private.skip_ortmodule(); import onnxruntime; "
            "schema = ort_private.checkpoint_schema('Checkpoint'); "
            "print(onnxruntime.__version__, schema.Checkpoint.__name__, "
            "sorted(m for m in ('torch', 'sympy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == [ort_private.VERSION, "Checkpoint", "[]"]
