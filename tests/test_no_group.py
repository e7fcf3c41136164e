"""A job of several ranks with no pipeline group known, run for real under torchrun (2 gloo processes).

``init_process_group`` was called, but no megatron-core parallel_state, no ``pp_group=`` and no
``pg_collection=``: the writer rank used to log its own memory alone as ``pp_stage_0``, silently.
Now the run reduces over the whole world, as ``memory_reduce_scope="world"`` (the exact rank of
each max), and the writer rank warns once how to give the pipeline group.

Rank 0 holds a 300 MB ballast, so its peak host RSS is the job's: the logged maximum is held
against rank 0's own VmHWM, read from /proc apart from nemo_memlog.

This file is also the rank script: ``torchrun tests/test_no_group.py OUT_DIR``; each rank writes
what it saw to OUT_DIR/rank-N.json.
"""

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

BALLAST_BYTES = 300 * 10**6
ITERATIONS = 3


def vm_hwm_gb() -> float:
    """This process's peak RSS (VmHWM), read here, apart from nemo_memlog."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise AssertionError("no VmHWM in /proc/self/status")


def rank_main(out: str) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    import numpy
    import torch
    import torch.distributed as dist

    from nemo_memlog import LoggerConfig, close_writers, training_log

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ballast = numpy.ones(BALLAST_BYTES, dtype=numpy.uint8) if rank == 0 else None  # every page touched
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir="off", memory_reduce_timeout_s=60)
    model = torch.nn.Linear(32, 32)  # and no optimizer: its state is missing on every rank
    seen = {"rank": rank, "parallel_state": "megatron.core.parallel_state" in sys.modules}
    before = vm_hwm_gb()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logged = [training_log(iteration, cfg, model=model) for iteration in range(1, ITERATIONS + 1)]
    seen.update(before=before, after=vm_hwm_gb(), logged=logged)
    seen["notes"] = [str(w.message) for w in caught if "no pipeline-parallel group" in str(w.message)]
    seen["ballast"] = 0 if ballast is None else int(ballast[-1])
    close_writers()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_without_a_pipeline_group_the_world_is_reduced_with_a_note_once(tmp_path):
    from nemo_memlog.testing.torchrun import run_ranks

    seen = run_ranks(__file__, [tmp_path], tmp_path, ranks=(0, 1))
    assert not seen[0]["parallel_state"] and not seen[1]["parallel_state"]  # nothing set the groups up
    rank0 = seen[0]
    # Rank 0's ballast makes its peak the job's, by far: held against VmHWM read apart from nemo_memlog.
    assert rank0["before"] > seen[1]["after"] + 0.8 * BALLAST_BYTES / 1e9, (rank0["before"], seen[1]["after"])
    for rank in (0, 1):
        steps = seen[rank]["logged"]
        assert len(steps) == ITERATIONS and all(step is not None for step in steps)
        assert steps == seen[1]["logged"]  # every rank gets the same dict
        for logged in steps:
            peak = logged["memory/peak_host_rss_gb"]
            assert rank0["before"] - 1e-6 <= peak <= rank0["after"] + 1e-6, (peak, rank0)
            assert logged["memory/peak_rank/peak_host_rss_gb"] == 0
            assert logged["memory/pp_stage_0/peak_host_rss_gb"] == peak
            assert not [key for key in logged if key.endswith("optimizer_state_gb")]  # no optimizer given
            assert logged["memory/model_state_gb"] == logged["memory/params_gb"] + logged["memory/grads_gb"]
    # The note: once, on the writer rank (the last), naming the ways to give the group.
    assert seen[0]["notes"] == []
    (note,) = seen[1]["notes"]
    assert "job of 2 ranks" in note and "reduced over the whole world" in note, note
    for way in (
        "pp_group=",
        "pg_collection=",
        "parallel_state.initialize_model_parallel",
        "memory_reduce_scope='world'",
    ):
        assert way in note, note


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[1:]))
