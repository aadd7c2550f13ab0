"""The structure of src/: no import circle and no import of a higher layer (from every
module's import statements, also the ones inside functions, which hide a circle from
Python but not from a reader), and no function over 60 lines."""

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


# The layers of src/ortflow/, lowest first: a module imports modules of its own layer or of lower
# ones, never of a higher one (imports inside functions count). A layer names the top-level
# modules and packages of ortflow in it (a package brings all its modules; `__init__` is ortflow's
# own, its version). A new one goes in the lowest layer above all it imports (or in a new layer of
# its own there), below all that imports it: one in no layer fails the test, which says where.
LAYERS = [
    # The foundation: errors, files (records.py: the ones a stage writes for others), the config,
    # ONNX Runtime's sessions and private parts.
    ("__init__", "errors", "wording", "digests", "storage", "atomic", "external_data", "user_files",
     "sessions", "ort_private", "artifacts", "config", "cuda_libraries", "launcher", "machine", "hugepages",
     "records", "onnx_nodes"),
    ("kernels",),  # ortflow's own ONNX Runtime operators, compiled at first use
    ("checkpoints",),  # ONNX Runtime's checkpoint file and ortflow's sharded checkpoints
    ("models",),  # models/weights.py reads weights from ONNX Runtime's checkpoint file
    ("data",),  # the tokenizer and the sources take the models' label conventions (IGNORE_INDEX)
    ("graphs",),  # build_artifacts' steps: models, the smoke step's shards, ONNX Runtime's checkpoint file
    ("evaluation",),  # the eval loss and accuracy over data's shards
    ("inference",),  # the loss of logits, their labels laid out as evaluation does
    ("export",),  # the inference model, its checks against the eval graph, the torch formats
    ("generation",),  # a causal LM's decoder with a KV cache, its folder, generation from it
    ("quantization",),  # int8 with its gate and latency
    ("training",),  # the ranks' loop: graphs (pipeline stages), evaluation, data, checkpoints
    ("diagnosis",),  # doctor's checks, from training's preflight and communicator
    ("reporting",),  # a run's results: training's schedule, the best checkpoint, data's baseline
    ("sweeps",),  # the points' run folders and their comparison, shown as reporting shows a run
    ("stages",),  # one module a rule; a stage never imports another (STAGES)
    ("cli",),  # the table of stage commands
]
STAGES = "stages"


def unit(module: str) -> str:
    """The top-level module or package of its package that `module` is in: `__init__` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int | None:
    """The index in `layers` of the layer that `module` is in; None for none."""
    return next((i for i, names in enumerate(layers) if unit(module) in names), None)


def unplaced(graph: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """A line for each top-level module or package in no layer, saying between which layers it
    fits, and for each name in `layers` that is no module or package of the graph."""
    package = next(iter(graph)).split(".")[0]
    named, units = {name for names in layers for name in names}, {unit(m) for m in graph}
    found = [f"LAYERS names {package}.{name}, which does not exist" for name in sorted(named - units)]
    placed = {m: layer_of(m, layers) for m in graph if unit(m) in named}
    for name in sorted(units - named):
        inside = {m for m in graph if unit(m) == name}
        imports = [(placed[t], t) for m in inside for t in graph[m] if t in placed]
        importers = [(placed[m], m) for m in placed if graph[m] & inside]
        above = "imports no placed module" if not imports else "imports layer %d (%s)" % max(imports)
        below = "nothing placed imports it" if not importers else "layer %d imports it (%s)" % min(importers)
        found.append(f"{package}.{name} is in no layer of LAYERS: it {above}; {below}")
    return found


def wrong_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """A line for each import of a higher layer's module, and for each from one stage to another
    (modules in no layer are `unplaced`'s)."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = layer_of(module, layers), layer_of(target, layers)
            if low is not None and high is not None and high > low:
                found.append(f"{module} ({unit(module)}, layer {low}) imports {target} "
                             f"({unit(target)}, layer {high}), a higher layer")
            elif unit(module) == unit(target) == STAGES:
                found.append(f"{module} imports {target}: a stage imports no other stage")
    return found


def test_every_import_in_src_is_of_its_own_layer_or_a_lower_one():
    graph = import_graph(SRC, "ortflow")
    assert "ortflow.data.shards" in graph["ortflow.graphs.smoke_step"]  # imported inside a function
    assert layer_of("ortflow.errors") < layer_of("ortflow.models.weights") < layer_of("ortflow.stages.train")
    assert unplaced(graph) == []
    assert wrong_imports(graph) == []


def test_an_upward_import_inside_a_function_and_a_package_in_no_layer_are_found(tmp_path):
    package = tmp_path / "pkg"
    for sub in ("low", "high", "new"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text("")
    (package / "high" / "a.py").write_text("from .. import base\nfrom ..low import b\n")  # downward: allowed
    (package / "low" / "b.py").write_text("def f():\n    from pkg.high.a import thing\n")  # upward, hidden in f
    (package / "new" / "c.py").write_text("from ..low import b\n")
    (package / "high" / "d.py").write_text("from ..new import c\n")
    layers = [("__init__", "base"), ("low",), ("high",), ("gone",)]
    graph = import_graph(tmp_path, "pkg")
    assert unplaced(graph, layers) == [
        "LAYERS names pkg.gone, which does not exist",
        "pkg.new is in no layer of LAYERS: it imports layer 1 (pkg.low.b); layer 2 imports it (pkg.high.d)"]
    assert wrong_imports(graph, layers) == [
        "pkg.low.b (low, layer 1) imports pkg.high.a (high, layer 2), a higher layer"]


def test_an_import_between_stages_and_one_upward_are_found():
    graph = {"ortflow.stages.report": {"ortflow.stages.merge_checkpoint"},
             "ortflow.config": {"ortflow.training.lamb"}, "ortflow.training.lamb": {"ortflow.errors"}}
    training = LAYERS.index(("training",))
    assert wrong_imports(graph) == [
        f"ortflow.config (config, layer 0) imports ortflow.training.lamb (training, layer {training}), a higher layer",
        "ortflow.stages.report imports ortflow.stages.merge_checkpoint: a stage imports no other stage"]


def test_the_command_line_imports_no_heavy_library_before_its_command_runs():
    """`ortflow <command>` builds its parser from every command's module (cli.py); each imports
    torch, onnxruntime and the like inside `run`. One module importing torch at its top made every
    process of every stage import torch first: `ortflow --help` took 9.1 s and 234 MB, now 2.0 s and
    44 MB (AMD EPYC, 2 cores under load 27)."""
    import subprocess
    import sys

    heavy = ("torch", "onnxruntime", "onnx", "transformers", "datasets", "tokenizers", "h5py", "pandas",
             "matplotlib", "mpi4py")
    code = ("import sys; from ortflow import cli; cli.build_parser(); "
            f"print(' '.join(name for name in {heavy!r} if name in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.split() == [], imported
