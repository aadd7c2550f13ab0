"""The workflow stays as its style asks: `snakefmt` formatted, `snakemake --lint` clean."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_snakefmt_leaves_the_workflow_unchanged():
    result = subprocess.run([str(BIN / "snakefmt"), "--check", "Snakefile", "workflow/"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.e2e
def test_snakemake_lint_is_clean(tmp_path):
    result = subprocess.run([str(BIN / "snakemake"), "--lint", "--snakefile", str(REPO / "Snakefile"),
                             "--directory", str(REPO)], capture_output=True, text=True)
    output = result.stdout + result.stderr
    # Snakemake exits non-zero on lints and when it crashes before linting (no "Lints for" then).
    assert result.returncode == 0, output
    assert "Lints for" not in output and "your workflow is in a good condition" in output, output
