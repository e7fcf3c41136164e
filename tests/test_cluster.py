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


def test_torchruns_tail_shows_the_rank_that_failed_first():
    """CI's failing run: rank 1's error came first, then over 3000 characters of rank 0's and torchrun's."""
    import subprocess

    from nemo_memlog.testing.torchrun import tail

    cause = ["[rank1]: Traceback (most recent call last):", "[rank1]: ValueError: Path is not a file: 'x.txt'"]
    between = [f"iteration {i} of rank 0, still training" for i in range(100)]  # 3700 characters
    later = ["[rank0]: RuntimeError: Connection closed by peer", *(f"torchrun summary {i}" for i in range(100))]
    shown = tail(subprocess.CompletedProcess([], 1, "stdout\n", "\n".join([*cause, *between, *later])))
    assert shown.startswith("[rank1]'s error, its last lines:\n" + "\n".join(cause) + "\n"), shown[:300]
    assert shown.endswith("torchrun summary 99") and shown.count("ValueError") == 1
    assert "[rank0]'s error" not in shown  # its line is in the tail already: said once
