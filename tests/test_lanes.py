"""The test lanes say themselves which tests start processes: a test that starts one without
``@pytest.mark.processes`` fails (tests/conftest.py), so it cannot drift into ``make test-fast``;
and every module under tests/gpu carries the ``gpu`` marker."""

import ast
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
HINT = "without @pytest.mark.processes: mark it (make test-fast runs unmarked tests)"

#: A test for each way of starting a process, unmarked; and the same, marked; and no process at all.
INNER = textwrap.dedent("""
    import multiprocessing
    import os
    import subprocess
    import sys

    import pytest


    def run_python():
        subprocess.run([sys.executable, "-c", "pass"], check=True)


    def spawn():
        process = multiprocessing.get_context("spawn").Process(target=os.getpid)
        process.start()
        process.join()


    @pytest.fixture
    def started_in_setup():
        run_python()


    @pytest.fixture
    def started_in_teardown():
        yield
        run_python()


    def test_subprocess_unmarked():
        run_python()


    def test_spawn_unmarked():
        spawn()


    def test_setup_unmarked(started_in_setup):
        pass


    def test_teardown_unmarked(started_in_teardown):
        pass


    def test_failing_unmarked():
        run_python()
        assert False, "its own failure"


    @pytest.mark.processes
    def test_subprocess_marked(started_in_setup, started_in_teardown):
        run_python()
        spawn()


    def test_pure():
        assert sum(range(4)) == 6
""")


@pytest.mark.processes
def test_a_test_that_starts_a_process_unmarked_fails_and_marked_passes(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the inner session loads tests/conftest.py as a plugin
    pytester.makeini("[pytest]\nmarkers =\n    processes: starts processes\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "tests.conftest", "-p", "no:cacheprovider", "-rA")
    # The setup case errs; the teardown case passes its call and errs in its teardown.
    result.assert_outcomes(passed=3, failed=3, errors=2)
    out = result.stdout.str()
    for name, event in [
        ("test_subprocess_unmarked", "subprocess.Popen"),
        ("test_spawn_unmarked", "multiprocessing.Process.start"),
        ("test_setup_unmarked", "subprocess.Popen"),
        ("test_teardown_unmarked", "subprocess.Popen"),
        ("test_failing_unmarked", "subprocess.Popen"),  # told even where the test fails of itself
    ]:
        assert f"test_inner.py::{name} started a process ({event} from " in out, (name, out)
    assert out.count(HINT) >= 5 and "its own failure" in out
    result.stdout.re_match_lines([r"PASSED test_inner.py::test_subprocess_marked", r"PASSED test_inner.py::test_pure"])
    assert "test_inner.py::test_subprocess_marked started a process" not in out
    assert "test_inner.py::test_pure started a process" not in out


def test_every_module_under_tests_gpu_is_marked_gpu():
    unmarked = []
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        marks = [
            node.value
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
        ]
        names = {ast.unparse(n) for mark in marks for n in (mark.elts if isinstance(mark, ast.List) else [mark])}
        if "pytest.mark.gpu" not in names:
            unmarked.append(path.name)
    assert unmarked == [], f"modules under tests/gpu without pytestmark = [..., pytest.mark.gpu]: {unmarked}"


def test_the_longest_files_named_first_are_files_of_the_suite():
    from tests.conftest import LONGEST_FIRST

    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert missing == [], f"tests/conftest.py's LONGEST_FIRST names files that are not there: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
