"""The conda environment files under envs/ stay in step with pyproject.toml (there is no conda here to build them)."""

from __future__ import annotations

import re
import tomllib

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from conftest import REPO

ENVS = sorted((REPO / "envs").glob("*.yaml"))


def pinned(lines) -> dict[str, str]:
    """{normalized name: version specifier} of requirement strings."""
    requirements = [Requirement(line) for line in lines]
    return {re.sub(r"[-_.]+", "-", r.name.lower()): str(r.specifier) for r in requirements}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_every_env_has_the_pyproject_packages_and_pins():
    assert ENVS, "envs/ holds no environment file"
    expected = pinned(pyproject()["dependencies"])
    python = SpecifierSet(pyproject()["requires-python"])
    for env in ENVS:
        dependencies = yaml.safe_load(env.read_text())["dependencies"]
        pip = next(d["pip"] for d in dependencies if isinstance(d, dict))
        packages = [line for line in pip if not line.startswith("-e ")]
        assert pinned(packages) == expected, f"{env.name}: pip packages differ from pyproject.toml"
        assert "-e .." in pip, f"{env.name}: does not install ortflow from this checkout"
        conda_python = next(d for d in dependencies if isinstance(d, str) and d.startswith("python="))
        assert python.contains(conda_python.split("=")[1]), f"{env.name}: {conda_python}, pyproject.toml: {python}"


def test_rules_name_existing_env_files():
    for rules in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for env in re.findall(r"conda:\s*\n\s*\"([^\"]+)\"", rules.read_text()):
            assert (rules.parent / env).resolve() in ENVS, f"{rules.name}: conda env {env} is not a file under envs/"
