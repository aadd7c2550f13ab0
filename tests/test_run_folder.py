"""The training folder's layout has one definition (ortflow.training.run_folder):
the launcher, the ranks and the rules use it, and nothing else spells its paths."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ortflow.training.run_folder import TrainFolder

REPO = Path(__file__).resolve().parents[1]
DEFINITION = REPO / "src/ortflow/training/run_folder.py"


def layout_names() -> set[str]:
    """The names of the files and folders TrainFolder defines."""
    folder = TrainFolder("x")
    return {value.name for value in vars(folder).values() if isinstance(value, Path) and value != folder.folder}


def test_the_layout_is_the_documented_one():
    assert layout_names() == {"metrics.json", "checkpoints", "tensorboard", "profile", "heartbeat", "ready",
                              "attempt.lock", "STOPPED", "FINISHED", "previous"}
    text = DEFINITION.read_text()
    for name in layout_names():  # each one is in the module's table of the layout
        assert re.search(rf"^    {re.escape(name)}", text, re.M), name


def test_no_path_of_the_training_folder_is_spelled_outside_its_definition():
    """No `<path> / "checkpoints"` (or any other name of the layout) in src/ outside
    run_folder.py, and no path under `{RESULTS}/train/` in the workflow's rules (which
    name the folder itself once, TRAIN in common.smk)."""
    names = layout_names()
    found = []
    for path in sorted((REPO / "src").rglob("*.py")):
        if path == DEFINITION:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and \
                    isinstance(node.right, ast.Constant) and node.right.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} / {node.right.value!r}")
    for path in [REPO / "Snakefile", *sorted((REPO / "workflow/rules").glob("*.smk"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "{RESULTS}/train/" in line:
                found.append(f"{path.relative_to(REPO)}:{number} {line.strip()}")
    assert not found, "the training folder's paths belong in ortflow/training/run_folder.py:\n" + "\n".join(found)
