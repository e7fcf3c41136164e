"""The test helpers' gloo ``Cluster``: a cluster whose ranks all die fails at once, naming their exit
codes, instead of waiting out its timeout."""

from __future__ import annotations

import os

import pytest

from nemo_memlog.testing.cluster import Cluster

pytestmark = pytest.mark.processes


def _die(code: int) -> None:
    os._exit(code)


def test_ranks_that_all_die_fail_the_run_at_once_with_their_exit_codes():
    with Cluster(world=2, pp=2) as cluster:
        # At once, not at the timeout: a wait that ran out would raise TimeoutError ("gave no result
        # within"), not this RuntimeError naming the deaths.
        with pytest.raises(
            RuntimeError, match=r"ranks \[0, 1\] died before giving a result \(exit codes \{0: 3, 1: 3\}\)"
        ):
            cluster.run(_die, 3, timeout=120)
