import contextlib

import pytest

from nemo_memlog.testing.cluster import Cluster
from nemo_memlog.testing.tmp import private_tmpdir

_session_tmp = contextlib.ExitStack()


@pytest.hookimpl(trylast=True)  # after pytest's own tmp path plugin has set up
def pytest_configure(config):
    """One TMPDIR for the whole session, this process and every process it starts, under
    pytest's own temporary root: what they leave there (W&B's tmp*wandb-media folders, from
    processes that end without atexit) goes with it at the end, or with pytest's rotation of
    old roots if the session dies. Set before collection, so imports at collection land there."""
    factory = getattr(config, "_tmp_path_factory", None)  # the object tmp_path_factory returns
    _session_tmp.enter_context(private_tmpdir(factory.getbasetemp() if factory is not None else None))


def pytest_unconfigure(config):
    _session_tmp.close()


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
