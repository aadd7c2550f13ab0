"""The structure of src/: no import circle (from every module's import statements, also
the ones inside functions, which hide a circle from Python but not from a reader), and
no function over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: the modules of `package` it imports}, for every .py file under root/package."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
                targets |= {f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the modules along it (depth-first search for back edges)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_circle_in_src():
    graph = import_graph(SRC, "ortflow")
    assert "ortflow.training.trainer" in graph and "ortflow.training.gradients" in graph["ortflow.training.trainer"]
    assert circles(graph) == []


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("def g():\n    from pkg.a import thing\n")
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


MAX_FUNCTION_LINES = 60


def long_functions(root: Path) -> list[str]:
    """`module:function (N lines)` for each function or method under `root` longer than MAX_FUNCTION_LINES,
    counted from its `def` (or first decorator) to its last line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.name} ({lines} lines)")
    return found


def test_no_function_in_src_is_over_60_lines():
    assert long_functions(SRC / "ortflow") == []


def test_a_long_function_is_found(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    method = "".join("    " + line for line in body.splitlines(True))
    (tmp_path / "m.py").write_text(f"def short():\n{body}\n\nclass C:\n    def long(self):\n{method}        pass\n")
    assert long_functions(tmp_path) == [f"m.py:long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_pyflakes_finds_no_undefined_name_or_unused_code():
    """pyflakes over src/, tests/ and bench/: an undefined name (a variable a
    refactoring renamed on one side only) fails on the path that reaches it, which
    the tests may not take (the doctor's CUDA rows run only where CuPy imports).
    In tests/, pytest fixtures imported from another test module count as used."""
    from pyflakes import api, messages, reporter

    class Collect(reporter.Reporter):
        def __init__(self):
            self.found = []

        def flake(self, message):
            fixture = isinstance(message, (messages.UnusedImport, messages.RedefinedWhileUnused)) and \
                Path(message.filename).is_relative_to(REPO / "tests")
            if not fixture:
                self.found.append(str(message))

        def unexpectedError(self, filename, problem):
            self.found.append(f"{filename}: {problem}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

    collect = Collect()
    api.checkRecursive([str(REPO / folder) for folder in ("src", "tests", "bench")], collect)
    assert collect.found == []


# The layers of src/ortflow/, lowest first. The foundation is the modules at the top of the
# package (errors, files, the config, ONNX Runtime's private parts); the libraries are its
# packages, by concern; stages/ holds the stage commands, one a rule; cli.py runs them.
FOUNDATION, LIBRARY, STAGE, CLI = range(4)


def layer(module: str) -> int:
    parts = module.split(".")
    if module == "ortflow.cli":
        return CLI
    if len(parts) == 1:  # the package itself: its version
        return FOUNDATION
    if parts[1:2] == ["stages"]:
        return STAGE
    return LIBRARY if len(parts) > 2 or (SRC / Path(*parts) / "__init__.py").is_file() else FOUNDATION


def wrong_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each import that points upward, or from one stage to another."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            upward = layer(target) > layer(module)
            between_stages = layer(module) == layer(target) == STAGE
            if upward or between_stages:
                found.append(f"{module} -> {target}")
    return found


def test_stages_import_libraries_never_another_stage_and_no_library_imports_upward():
    graph = import_graph(SRC, "ortflow")
    assert layer("ortflow.stages.train") == STAGE and layer("ortflow.training.trainer") == LIBRARY
    assert layer("ortflow.config") == FOUNDATION and layer("ortflow.evaluation") == LIBRARY
    assert wrong_imports(graph) == []


def test_an_import_between_stages_and_one_upward_are_found():
    graph = {"ortflow.stages.report": {"ortflow.stages.merge_checkpoint"},
             "ortflow.config": {"ortflow.training.lamb"}, "ortflow.training.lamb": {"ortflow.errors"}}
    assert wrong_imports(graph) == ["ortflow.config -> ortflow.training.lamb",
                                    "ortflow.stages.report -> ortflow.stages.merge_checkpoint"]
