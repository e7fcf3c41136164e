"""Tests that need a CUDA GPU: skipped without one, collected by ``make test`` with the rest.

Every test here runs its CUDA work in processes of its own (``fresh.run_alone``, or a
nemo_memlog.testing.cluster.Cluster), never in pytest's process: the CPU tests that follow in the same
session assume a process that has not initialised CUDA (and fork-based tools must not
inherit a CUDA context).
"""

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")
