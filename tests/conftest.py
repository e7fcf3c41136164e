import pytest

from nemo_memlog.testing.cluster import Cluster


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
