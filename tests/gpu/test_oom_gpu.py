"""A real CUDA out-of-memory error, caught by the recorder's allocator observer (skipped without CUDA).

Needs only torch (with CUDA) and nemo_memlog: ``python -m pytest -q tests/gpu``. Each case runs
in a fresh process, so CUDA's state (the observer list, the OOM counter, the allocator's
history) starts clean. The process asks for twice the device's free memory, catches
torch.OutOfMemoryError as a training script would not, and prints what it saw as JSON; the
test reads the record file back with records.py.
"""

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nemo_memlog.failure import records

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.gpu,
    pytest.mark.processes,
]
ROOT = Path(__file__).resolve().parents[2]

OOM_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from nemo_memlog import LoggerConfig, close_writers, training_log

    root, order, history = sys.argv[1], sys.argv[2], sys.argv[3] == "history"
    fired = []
    def theirs(device, requested, limit, free):  # another observer (Megatron-Bridge's, Composer's)
        fired.append("theirs")
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=root, memory_record_history=history)
    if order == "cuda-first":  # the usual order: the model is on the device before the first logging step
        ballast = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
        torch._C._cuda_attach_out_of_memory_observer(theirs)
        training_log(1, cfg)
    else:  # the recorder opens before CUDA is initialised: it attaches at the next logging step
        training_log(1, cfg)
        ballast = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
        torch._C._cuda_attach_out_of_memory_observer(theirs)
        training_log(2, cfg)
    # A successful allocation while recording: the history (when asked for) has an alloc with its stack.
    scratch = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
    free, total = torch.cuda.mem_get_info()
    asked = 2 * free
    try:
        torch.empty(asked, dtype=torch.uint8, device="cuda")
        raised = False
    except torch.OutOfMemoryError:
        raised = True
    stats = torch.cuda.memory_stats()
    close_writers()
    print(json.dumps({"raised": raised, "asked": asked, "total": total, "fired": fired,
                      "num_ooms": stats["num_ooms"], "retries": stats["num_alloc_retries"]}))
""")


def provoke(tmp_path, order="cuda-first", history="no-history"):
    done = subprocess.run(
        [sys.executable, "-c", OOM_SCRIPT, str(tmp_path), order, history],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["raised"] and seen["num_ooms"] == 1, seen
    data = (tmp_path / records.file_name(0)).read_bytes()
    header = records.check_header(records.decode(data[: records.HEADER_BYTES]))
    size = header["slot_bytes"]
    found = [
        records.decode(data[records.RECORDS_AT + i * size : records.RECORDS_AT + (i + 1) * size])
        for i in range(header["slots"])
    ]
    found = sorted((r for r in found if r is not None), key=lambda r: r["seq"])
    (oom,) = [r for r in found if r["kind"] == "oom"]
    return seen, oom, found


def test_a_real_cuda_oom_writes_its_record_and_snapshot(tmp_path):
    seen, oom, found = provoke(tmp_path)
    assert [r["kind"] for r in found] == ["step", "oom", "end"] and found[-1]["reason"] == "close"
    assert oom["iteration"] == 1 and oom["device"] == torch.cuda.current_device()
    # torch passes the request rounded up to the allocator's block size (2 MiB for a large one).
    assert seen["asked"] <= oom["bytes_requested"] < seen["asked"] + (20 << 20), (seen, oom)
    assert oom["device_limit"] == seen["total"]  # no per-process fraction set: the device's total
    assert 0 <= oom["device_free"] < oom["bytes_requested"]
    assert (
        oom["report"]["peak_reserved_gb"] >= 0.064 and abs(oom["report"]["device_total_gb"] * 1e9 - seen["total"]) < 1e3
    )
    assert seen["fired"] == ["theirs"]  # the other observer still fired
    snapshot = pickle.loads((tmp_path / oom["snapshot"]).read_bytes())
    assert oom["snapshot"] == "rank-00000.oom-0.pickle" and snapshot["segments"]
    reserved = sum(segment["total_size"] for segment in snapshot["segments"])
    assert 0 <= oom["largest_free_block"] <= oom["reserved_free"] <= reserved
    assert not any(
        segment.get("blocks") and any(b.get("frames") for b in segment["blocks"]) for segment in snapshot["segments"]
    )  # no history asked for: no stack traces


def test_the_post_mortem_names_the_real_oom(tmp_path):
    """``nemo-memlog postmortem --json`` on the records a real CUDA OOM left: the rank, its
    status, the request, and an exit status of 1 (a failure found)."""
    seen, oom, _ = provoke(tmp_path / "records")
    done = subprocess.run(
        [sys.executable, "-m", "nemo_memlog.cli", "postmortem", "--json", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1, done.stderr
    verdict = json.loads(done.stdout)
    assert verdict["first_failure"]["rank"] == 0 and verdict["first_failure"]["status"] == "cuda_oom", verdict
    (rank,) = verdict["ranks"]
    assert rank["status"] == "cuda_oom" and rank["last_iteration"] == 1
    assert "CUDA OOM" in verdict["first_failure"]["sentence"], verdict["first_failure"]


def test_observer_attached_when_cuda_starts_after_the_recorder(tmp_path):
    seen, oom, found = provoke(tmp_path, order="recorder-first")
    assert [r["kind"] for r in found] == ["step", "step", "oom", "end"]
    assert oom["iteration"] == 2 and seen["fired"] == ["theirs"] and oom["snapshot"]


def test_memory_record_history_puts_alloc_traces_in_the_snapshot(tmp_path):
    seen, oom, found = provoke(tmp_path, history="history")
    snapshot = pickle.loads((tmp_path / oom["snapshot"]).read_bytes())
    traces = [event for trace in snapshot["device_traces"] for event in trace]
    assert any(event["action"] == "alloc" and event.get("frames") for event in traces)
