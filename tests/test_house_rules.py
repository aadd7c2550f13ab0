"""Rules for tests/ itself.

A test that starts Snakemake or MPI ranks is marked e2e, so that the fast loop
(-m "not e2e and not cluster and not slow") leaves it out: conftest's run_snakemake and
run_on_ranks fail any other.

No timing is asserted: how fast something runs depends on the machine and on what else
it runs, so a test that asserts it fails on a busy machine and passes on a fast one;
timings are measured in bench/ (docs/benchmarks.md). A timing assertion is an `assert`
(or an `if` that fails the test) that orders a clock's reading (time.time, perf_counter,
monotonic, process_time, or a name computed from one, such as `elapsed`) or a speed
against a bound. A deadline that bounds a wait for an event (a `while` loop's condition,
a subprocess's timeout) is not one: the test then asserts on the event. Percentiles
compared with each other (p50 <= p95) are not one either: they are the same
measurement's order, whatever the machine."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO, run_on_ranks, run_snakemake

CLOCKS = {"time", "perf_counter", "monotonic", "process_time", "thread_time"}
CLOCKS |= {f"{name}_ns" for name in CLOCKS}
# Names and keys of a speed or a duration: a speed-up, elapsed seconds, a latency, a rate.
SPEED = re.compile(r"speed_?up|faster|elapsed|duration|latency|seconds|_ms$|_s$|per_s$", re.IGNORECASE)
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
    return name in CLOCKS and (not isinstance(function, ast.Attribute) or getattr(function.value, "id", "") == "time")


def clock_names(tree: ast.AST) -> set[str]:
    """Names assigned from a clock's reading, or from another such name (start, elapsed, deadline)."""
    names: set[str] = set()
    assignments = [(node.targets if isinstance(node, ast.Assign) else [node.target], node.value)
                   for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr))
                   and node.value is not None]
    while True:
        found = {target.id for targets, value in assignments for target in targets
                 if isinstance(target, ast.Name) and reads_clock(value, names)}
        if found <= names:
            return names
        names |= found


def reads_clock(node: ast.AST, names: set[str]) -> bool:
    return any(is_clock_call(n) or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(node))


def is_speed(node: ast.AST) -> bool:
    """A name, attribute or subscript key that names a speed or a duration."""
    for n in ast.walk(node):
        word = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else \
            n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
        if word is not None and SPEED.search(word):
            return True
    return False


def is_timing_comparison(node: ast.AST, clocks: set[str]) -> bool:
    """An ordering of a clock's reading against anything, or of a speed against a bound
    that is not a speed (0 excepted: a measured time is positive on any machine)."""
    if not (isinstance(node, ast.Compare) and any(isinstance(op, ORDER) for op in node.ops)):
        return False
    operands = [node.left, *node.comparators]
    if any(reads_clock(operand, clocks) for operand in operands):
        return True
    speeds = [is_speed(operand) for operand in operands]
    bounds = [o for o, speed in zip(operands, speeds) if not speed and not (isinstance(o, ast.Constant) and o.value == 0)]
    return any(speeds) and bool(bounds)


def fails_the_test(body: list[ast.stmt]) -> bool:
    """`pytest.fail(...)` or `raise AssertionError(...)` among the statements."""
    for node in (n for statement in body for n in ast.walk(statement)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "fail":
            return True
        if isinstance(node, ast.Raise) and "AssertionError" in ast.unparse(node.exc or ast.Constant(None)):
            return True
    return False


def timing_assertions(root: Path) -> list[str]:
    """`file:line: the assertion` for each timing assertion in the .py files under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        clocks = clock_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                checked = node.test
            elif isinstance(node, ast.If) and fails_the_test(node.body):
                checked = node.test
            else:
                continue
            if any(is_timing_comparison(n, clocks) for n in ast.walk(checked)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(checked)}")
    return found


def test_no_timing_is_asserted_in_tests():
    assert timing_assertions(REPO / "tests") == []


def test_a_timing_assertion_is_found(tmp_path):
    (tmp_path / "test_fast.py").write_text(
        "import time\n"
        "from time import perf_counter\n\n"
        "def test_clock():\n"
        "    start = time.perf_counter()\n"
        "    elapsed = time.perf_counter() - start\n"
        "    assert elapsed < 2.0\n"
        "    assert time.monotonic() - start <= 5\n"
        "    t0 = perf_counter()\n"
        "    if perf_counter() - t0 > 1:\n"
        "        pytest.fail('too slow')\n\n"
        "def test_speed(metrics):\n"
        "    speedup = metrics['fp32']['latency_ms'] / metrics['int8']['latency_ms']\n"
        "    assert speedup >= 1.5, metrics\n"
        "    assert metrics['samples_per_s'] > 1000 and metrics['wall_time_s'] < 60\n"
    )
    (tmp_path / "test_fine.py").write_text(
        "import time\n\n"
        "def test_waits_then_asserts_the_event(metrics, done):\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not done() and time.monotonic() < deadline:\n"
        "        time.sleep(0.1)\n"
        "    assert done()\n"
        "    assert 0 < metrics['b1_p50'] <= metrics['b1_p95'] and metrics['samples_per_s'] > 0\n"
        "    assert metrics['steps'] >= 300 and metrics['size_bytes'] < 10_000\n"
    )
    assert timing_assertions(tmp_path) == [
        "test_fast.py:7: elapsed < 2.0",
        "test_fast.py:8: time.monotonic() - start <= 5",
        "test_fast.py:10: perf_counter() - t0 > 1",
        "test_fast.py:15: speedup >= 1.5",
        "test_fast.py:16: metrics['samples_per_s'] > 1000 and metrics['wall_time_s'] < 60",
    ]


def test_a_test_that_starts_snakemake_or_ranks_must_be_marked_e2e(tmp_path):
    test = "test_house_rules.py::test_a_test_that_starts_snakemake_or_ranks_must_be_marked_e2e"
    with pytest.raises(pytest.fail.Exception, match=f"{test} runs Snakemake: mark it @pytest.mark.e2e"):
        run_snakemake(tmp_path, {})
    with pytest.raises(pytest.fail.Exception, match=f"{test} starts MPI ranks: mark it @pytest.mark.e2e"):
        run_on_ranks(tmp_path, "print('never run')", 2)
    assert list(tmp_path.iterdir()) == []


def conflict_markers(paths: list[Path]) -> list[str]:
    """'file:line' of each line a merge left unresolved (`<<<<<<< `, `>>>>>>> `) in `paths`."""
    return [f"{path}:{number}" for path in paths for number, line in enumerate(path.read_text().splitlines(), 1)
            if line.startswith(("<<<<<<< ", ">>>>>>> "))]


def test_no_merge_left_conflict_markers():
    texts = [path for pattern in ("*.md", "*.py", "*.smk", "*.yaml", "*.toml", "Snakefile")
             for path in REPO.rglob(pattern) if ".venv" not in path.parts and ".git" not in path.parts]
    assert len(texts) > 100 and conflict_markers(texts) == []


def test_a_conflict_marker_is_found(tmp_path):
    (tmp_path / "a.md").write_text("text\n<<<<<<< HEAD\nmine\n=======\ntheirs\n>>>>>>> branch\n")
    assert conflict_markers([tmp_path / "a.md"]) == [f"{tmp_path / 'a.md'}:2", f"{tmp_path / 'a.md'}:6"]
