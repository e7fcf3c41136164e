"""What the memory is made of, on a real GPU (skipped without CUDA): the model state against the
model's own tensors, and the activations, temporaries and slack against the allocator's own
statistics, each read apart by the test's script around the same logging call,
and a real CUDA OOM whose post-mortem gives the failing rank's breakdown. Each case runs in a fresh
process (the CPU tests that follow assume a process without CUDA)."""

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
    from nemo_memlog import LoggerConfig, close_writers, training_log

    def peaks():
        stats = torch.cuda.memory_stats()
        return {"allocated": stats["allocated_bytes.all.peak"], "reserved": stats["reserved_bytes.all.peak"]}

    def device_bytes(tensors):
        # numel * element_size of the tensors on the model's device: each of these has a storage of
        # its own (a Linear's weight and bias, their grads, Adam's moments), so this is what it holds.
        return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.device.type == "cuda")

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
        before = peaks()  # the allocator's own figures, read apart, around the logging call
        logged = training_log(iteration, cfg, model=model, optimizer=optimizer)
        after = peaks()
    params = list(model.parameters())
    state = [value for values in optimizer.state.values() for value in values.values() if torch.is_tensor(value)]
    out = {
        "logged": logged,
        "before": before,
        "after": after,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "params": device_bytes(params),
        "grads": device_bytes(p.grad for p in params),
        "optimizer_state": device_bytes(state),
    }
    try:
        torch.empty(2 * torch.cuda.mem_get_info()[0], dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        out["oom"] = True
    print(json.dumps(out))
""")
#: What the activation meter must see at iteration 2, counted by hand: each Linear saves its
#: (4096, 2048) float32 input.
ACTIVATIONS = 8 * 4096 * 2048 * 4


def test_activations_and_slack_add_up_to_the_allocators_peak_and_an_oom_gives_the_breakdown(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    logged, before, after = seen["logged"], seen["before"], seen["after"]

    def gb(nbytes):
        return nbytes / 1e9

    # The model state against the model's own tensors, counted here (numel * element_size of the
    # parameters, their grads and Adam's state on the GPU; Adam's step counters stay on the CPU
    # unless capturable or fused: host memory, in no part). Exact: the same bytes, divided by 1e9.
    assert logged["memory/params_gb"] == pytest.approx(gb(seen["params"]), rel=1e-12)
    assert logged["memory/grads_gb"] == pytest.approx(gb(seen["grads"]), rel=1e-12)
    assert logged["memory/optimizer_state_gb"] == pytest.approx(gb(seen["optimizer_state"]), rel=1e-12)
    model_state = seen["params"] + seen["grads"] + seen["optimizer_state"]
    assert logged["memory/model_state_gb"] == pytest.approx(gb(model_state), rel=1e-12)
    assert seen["params"] == seen["grads"] == 8 * (2048 * 2048 + 2048) * 4  # and by hand
    # exp_avg and exp_avg_sq; and the 16 step counters, where this torch keeps them on the GPU
    assert seen["optimizer_state"] - 2 * seen["params"] in (0, 16 * 4)
    # measured at iteration 2 (armed by the call at 1)
    assert logged["memory/activations_gb"] == pytest.approx(gb(ACTIVATIONS), rel=1e-9)
    assert logged["memory/microbatches_in_flight"] == 1

    # The peaks against the allocator's statistics read by the script just before and just after
    # the logging call: the logged peak lies between, and they differ by at most one 2 MiB segment
    # of the allocator's small pool (training_log's own device work, if any; none is expected).
    assert seen["max_memory_allocated"] == after["allocated"] and seen["max_memory_reserved"] == after["reserved"]
    slop = 2 * 2**20
    for name in ("allocated", "reserved"):
        assert after[name] - before[name] <= slop, (name, before, after)
        assert before[name] - 1 <= logged[f"memory/peak_{name}_gb"] * 1e9 <= after[name] + 1, (name, logged)
    tolerance = gb(after["allocated"] - before["allocated"] + after["reserved"] - before["reserved"]) + 1e-12

    # The derived parts against the same sums made of the figures read apart, unclamped: the slack
    # is the allocator's peak reserved less its peak allocated; the temporaries are the peak
    # reserved less every other part.
    slack = before["reserved"] - before["allocated"]
    temporaries = before["reserved"] - (model_state + ACTIVATIONS + slack)
    # A workload where it must be >= 0 unclamped, by a margin: at the end of iteration 2's forward
    # the GPU holds the model state, every saved input (ACTIVATIONS), and the last Linear's output
    # and its square besides (2 x 4096 x 2048 float32).
    assert temporaries >= 2 * 4096 * 2048 * 4, (temporaries, before, model_state)
    assert logged["memory/allocator_slack_gb"] == pytest.approx(gb(slack), abs=tolerance)
    assert logged["memory/temporaries_gb"] == pytest.approx(gb(temporaries), abs=tolerance)
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
