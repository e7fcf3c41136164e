import contextlib

import pytest

from nemo_memlog.testing.cluster import Cluster
from nemo_memlog.testing.tmp import private_tmpdir

_session_tmp = contextlib.ExitStack()
_roots: list = []  # pytest's temporary root of this session (pytest-of-<user>)


@pytest.hookimpl(trylast=True)  # after pytest's own tmp path plugin has set up
def pytest_configure(config):
    """One TMPDIR for the whole session, this process and every process it starts, under
    pytest's own temporary root: what they leave there (W&B's tmp*wandb-media folders, from
    processes that end without atexit) goes with it at the end, or with pytest's rotation of
    old roots if the session dies. Set before collection, so imports at collection land there."""
    factory = getattr(config, "_tmp_path_factory", None)  # the object tmp_path_factory returns
    base = factory.getbasetemp() if factory is not None else None
    _roots.append(base.parent if base is not None else None)
    _session_tmp.enter_context(private_tmpdir(base))


def pytest_unconfigure(config):
    _session_tmp.close()
    # A green session leaves pytest's own root (pytest-of-<user>) empty: take it away too, so the
    # system's temporary folder is as it was. A root still holding a run (a failed one) stays.
    for root in _roots:
        with contextlib.suppress(OSError):
            if root is not None:
                root.rmdir()


@pytest.fixture(scope="session")
def pp2dp2():
    """World 4 = PP 2 x DP 2: PP groups {0,2} and {1,3} are proper subgroups."""
    with Cluster(world=4, pp=2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def pp4():
    """World 4 = PP 4: one PP group of every rank."""
    with Cluster(world=4, pp=4) as cluster:
        yield cluster


#: Fixtures that start processes (a gloo cluster, torchrun, the demo, a Lightning job).
LAUNCHING_FIXTURES = {
    "bridge_alone",
    "demo",
    "flag_off",
    "job",
    "killed",
    "pp2",
    "pp2dp2",
    "pp2dp2_bridge",
    "pp4",
    "preempted",
    "runs",
    "stage2_holds_most",
    "started",
    "torn_down",
    "two_runs",
    "under_a_limit",
    "with_callback",
    "with_phases",
}
#: Modules whose tests start processes themselves (torchrun, a writer process, a Cluster of their own).
LAUNCHING_MODULES = {
    "test_bench_smoke",
    "test_bridge",
    "test_demo",
    "test_lightning",
    "test_misuse",
    "test_no_group",
    "test_postmortem_e2e",
    "test_readme",
    "test_sigterm",
    "test_teardown",
    "test_process",
    "test_isolation",
    "test_folders",
    "test_reduction_group",
    "test_hook",
    "test_reduce",
    "test_recorder",
    "test_phase",
    "test_peak_window",
    "test_host_limit",
    "test_composition",
    "test_megatron",
    "test_fit",
}


def pytest_collection_modifyitems(config, items):
    """Mark the tests that start processes: ``make test-fast`` runs the others (``-m "not processes"``)."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in LAUNCHING_MODULES or LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
