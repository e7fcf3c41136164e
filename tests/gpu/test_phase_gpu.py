"""A memory phase leaves the process's CUDA peak counters as they were under the default
``memory_peak_window="run"`` (every other reader of them sees no reset), and measures the phase's
device peaks under ``"interval"``. Skipped without CUDA; each window in a fresh process."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.gpu,
    pytest.mark.processes,
]
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from nemo_memlog import LoggerConfig, close_writers, memory_phase, training_log

    window, root = sys.argv[1], sys.argv[2]
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_peak_window=window, memory_record_dir=root)
    spike = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB, then freed: the peak
    del spike
    training_log(1, cfg)
    before = torch.cuda.max_memory_allocated()
    with memory_phase("eval"):
        small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
        del small
    after = torch.cuda.max_memory_allocated()
    logged = training_log(2, cfg)
    close_writers()
    print(json.dumps({"before": before, "after": after,
                      "phase_keys": sorted(k for k in logged if k.startswith("memory/phase/eval/"))}))
""")


@pytest.mark.parametrize("window", ["run", "interval"])
def test_a_phase_resets_no_cuda_peak_under_the_run_window(tmp_path, window):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, window, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if window == "run":
        assert seen["after"] == seen["before"] >= 2**30, seen  # nobody else's peak was reset
        assert "memory/phase/eval/peak_allocated_gb" not in seen["phase_keys"]
        assert "memory/phase/eval/peak_host_rss_gb" in seen["phase_keys"]
    else:
        assert "memory/phase/eval/peak_allocated_gb" in seen["phase_keys"]
