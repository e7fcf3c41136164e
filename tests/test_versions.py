"""The tests marked ``versions`` again, against Megatron-Bridge 0.3.1 on megatron-core 0.16.1: one
pytest session of the second environment (.venv-bridge03, which ``make test`` builds), run as one
test of this session, so that pytest-xdist packs it beside the other files on the two workers
instead of after them. The marker marks the tests whose expectations depend on Bridge's or
megatron-core's version (pyproject.toml); pytest exits 5, failing this test, should it select none."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-bridge03" / "bin" / "python"
#: The files holding the tests marked ``versions``.
VERSIONED_TESTS = ("tests/test_bridge.py", "tests/test_megatron.py")
#: What the second environment leaves out: Bridge's callback on PP 2 x DP 2. Its DP groups are
#: megatron-core's parallel_state and our reduction, which the main session holds; what Bridge 0.3.1
#: changes (its callbacks, its own memory logging, its train step) is held on PP 2 here. So that no
#: cluster of 4 Bridge ranks starts at all, the GPTModel jobs run on PP 2 there too (SECOND_ENVIRONMENT).
NOT_AGAIN = "not pp2dp2"
SECOND_ENVIRONMENT = {"NEMO_MEMLOG_TESTS_SECOND_ENVIRONMENT": "1"}


@pytest.mark.processes
@pytest.mark.slow
def test_the_versions_tests_pass_against_bridge_0_3_1_and_megatron_core_0_16_1():
    if not PYTHON.exists():
        pytest.skip(f"{PYTHON.parent.parent.name} is not built: `make test` builds it")
    done = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "versions", "-k", NOT_AGAIN,
         *VERSIONED_TESTS],
        cwd=ROOT, env={**os.environ, **SECOND_ENVIRONMENT}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(f"{PYTHON.parent.parent.name}: {summary[0]}")
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert " passed" in summary[0] and "skipped" not in summary[0], summary
