"""The test helpers' gloo ``Cluster``: a cluster whose ranks all die fails at once, naming their exit
codes, instead of waiting out its timeout."""

from __future__ import annotations

import os
import time

import pytest

from nemo_memlog.testing.cluster import Cluster

pytestmark = pytest.mark.processes


def _die(code: int) -> None:
    os._exit(code)


def test_ranks_that_all_die_fail_the_run_at_once_with_their_exit_codes():
    with Cluster(world=2, pp=2) as cluster:
        started = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"ranks \[0, 1\] died before giving a result \(exit codes \{0: 3, 1: 3\}\)"
        ):
            cluster.run(_die, 3, timeout=120)
        assert time.monotonic() - started < 30  # not the 120 s timeout
