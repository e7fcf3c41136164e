"""What the memory is made of, on a real GPU (skipped without CUDA): the measured activations,
temporaries and slack against the allocator's own statistics (they add up to its peak reserved),
and a real CUDA OOM whose post-mortem gives the failing rank's breakdown. Each case runs in a fresh
process (the CPU tests that follow assume a process without CUDA)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from nemo_memlog import LoggerConfig, close_writers, training_log

    root = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8))).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=root)
    torch.cuda.reset_peak_memory_stats()
    for iteration in (1, 2):
        optimizer.zero_grad(set_to_none=False)
        model(torch.randn(4096, 2048, device="cuda")).square().sum().backward()
        optimizer.step()
        logged = training_log(iteration, cfg, model=model, optimizer=optimizer)
    stats = torch.cuda.memory_stats()
    out = {"logged": logged, "peak_allocated": stats["allocated_bytes.all.peak"],
           "peak_reserved": stats["reserved_bytes.all.peak"]}
    try:
        torch.empty(2 * torch.cuda.mem_get_info()[0], dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        out["oom"] = True
    print(json.dumps(out))
""")


def test_activations_and_slack_add_up_to_the_allocators_peak_and_an_oom_gives_the_breakdown(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    logged = seen["logged"]
    params = 8 * (2048 * 2048 + 2048) * 4 / 1e9
    assert logged["memory/params_gb"] == pytest.approx(params, rel=1e-9)
    assert logged["memory/grads_gb"] == pytest.approx(params, rel=1e-9)
    assert logged["memory/optimizer_state_gb"] == pytest.approx(2 * params + 16 * 4 / 1e9, rel=1e-6)
    peak_allocated = logged["memory/peak_allocated_gb"]
    # measured at iteration 2 (armed by the call at 1): each Linear saves its (4096, 2048) float32 input
    assert logged["memory/activations_gb"] == pytest.approx(8 * 4096 * 2048 * 4 / 1e9, rel=1e-9)
    assert logged["memory/microbatches_in_flight"] == 1
    assert logged["memory/temporaries_gb"] >= 0
    parts = ("model_state_gb", "activations_gb", "temporaries_gb", "allocator_slack_gb")
    assert sum(logged[f"memory/{part}"] for part in parts) == pytest.approx(logged["memory/peak_reserved_gb"])
    assert logged["memory/allocator_slack_gb"] == pytest.approx(logged["memory/peak_reserved_gb"] - peak_allocated)
    assert seen["oom"]
    pm = subprocess.run(
        [sys.executable, "-m", "nemo_memlog.cli", "postmortem", "--json", "--no-png", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    sentence = json.loads(pm.stdout)["sentence"]
    assert "hit a CUDA OOM" in sentence and " is model state (" in sentence and " activations, " in sentence
