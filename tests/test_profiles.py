"""The Snakemake profiles of profiles/, as Snakemake's own command line reads
them (no job runs): the default one wherever `snakemake` runs, the Slurm one
retrying training alone."""

from __future__ import annotations

from snakemake.cli import parse_args
from snakemake.utils import available_cpu_count

from conftest import REPO


def test_the_default_profile_is_found_next_to_the_snakefile(tmp_path, monkeypatch, capfd):
    """From a folder without profiles/ (a run with --snakefile, as the tests do),
    Snakemake reads profiles/default beside the Snakefile: `cores: all`."""
    monkeypatch.chdir(tmp_path)
    _, args = parse_args(["--snakefile", str(REPO / "Snakefile")])
    assert f"workflow specific profile {REPO / 'profiles' / 'default'} " in capfd.readouterr().err
    assert args.cores == available_cpu_count()


def test_the_slurm_profile_retries_training_alone(monkeypatch):
    """An interrupted training job resumes from its checkpoint when it is
    submitted again; any other failed job would fail again the same way."""
    monkeypatch.chdir(REPO)
    _, args = parse_args(["--workflow-profile", "profiles/slurm"])
    assert args.executor == "slurm"
    assert args.retries == 0  # every rule but those below
    assert (args.preemptible_rules, args.preemptible_retries) == ({"train"}, 1)
