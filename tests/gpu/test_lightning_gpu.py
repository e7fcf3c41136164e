"""MemoryLogCallback on one real GPU: ``Trainer(accelerator="gpu", devices=1)`` logs the
CUDA allocator's keys into Lightning's TensorBoardLogger and CSVLogger. Skipped without CUDA.

The Trainer runs in a process of its own (tests/lightning_job.py, as the CPU tests run it),
so this pytest process never initialises CUDA. That process holds a CUDA ballast of a known
size for the whole fit. Needs torch, tensorboard and Lightning only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.lightning_job import Fit, run_job
from tests.lightning_readback import runs, series

LOGGING_STEPS = [1, 3, 5, 7]  # 8 steps, log_every_n_steps=2: Lightning's own steps

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)"),
    pytest.mark.gpu,
    pytest.mark.processes,
]

CUDA_BALLAST_MB = 512
CUDA_KEYS = [
    "memory/peak_allocated_gb",
    "memory/peak_reserved_gb",
    "memory/current_allocated_gb",
    "memory/headroom_gb",
    "memory/device_total_gb",
    "memory/peak_rank/peak_allocated_gb",
]


@pytest.fixture(scope="module")
def fit(tmp_path_factory) -> Fit:
    spec = {
        "world": 1,
        "accelerator": "gpu",
        "strategy": "auto",
        "ballast_mb": [0],
        "cuda_ballast_mb": CUDA_BALLAST_MB,
        "fits": [{"name": "gpu", "loggers": ["tensorboard", "csv"]}],
    }
    return run_job(spec, tmp_path_factory.mktemp("lightning_gpu"))["gpu"]


@pytest.mark.parametrize("backend", ["tensorboard", "csv"])
def test_one_gpu_trainer_logs_the_cuda_allocators_peak_at_lightnings_steps(fit, backend):
    stored = series(backend, fit.root)
    assert runs(backend, fit.root) == 1
    missing = [name for name in CUDA_KEYS if name not in stored]
    assert not missing, f"CUDA keys missing: {missing}"
    for name in CUDA_KEYS:
        assert [s for s, _ in stored[name]] == LOGGING_STEPS, name
    as_stored = (lambda v: float(np.float32(v))) if backend == "tensorboard" else float
    for step, value in stored["memory/peak_allocated_gb"]:
        event = fit.at(0, step)
        assert as_stored(event["cuda_peak_before"]) <= value <= as_stored(event["cuda_peak_after"]), (step, event)
        assert value >= CUDA_BALLAST_MB * 2**20 / 1e9, "the ballast is in the allocator's peak"
    total = dict(stored["memory/device_total_gb"])[LOGGING_STEPS[0]]
    assert total == pytest.approx(as_stored(torch.cuda.get_device_properties(0).total_memory / 1e9), rel=1e-6)
    assert [v for _, v in stored["memory/peak_rank/peak_allocated_gb"]] == [0] * len(LOGGING_STEPS)
