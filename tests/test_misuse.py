"""Misuse that used to be silent or misexplained, run for real under torchrun (2 processes):

- ``no_group``: torchrun started the processes but none called ``init_process_group``: each
  would have logged itself as a one-stage job into the same dashboards. ``training_log`` raises,
  naming the fix.
- ``one_rank``: a gloo job whose rank 0 leaves (its process ends) while rank 1 calls
  ``training_log``: the error says a peer left, in gloo's words, within a second or two, not
  "not every rank joined within memory_reduce_timeout_s".

This file is also the rank script: ``torchrun tests/test_misuse.py SCENARIO OUT_DIR``; each rank
writes what it saw to OUT_DIR/rank-N.json.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60.0


def rank_main(scenario: str, out: str) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    import torch.distributed as dist

    from nemo_memlog import LoggerConfig, training_log

    rank = int(os.environ["RANK"])
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir="off", memory_reduce_timeout_s=TIMEOUT_S)
    seen = {"rank": rank}
    group = None
    if scenario == "one_rank":
        dist.init_process_group("gloo")
        if rank == 0:
            os._exit(0)  # leaves without a word: its sockets close
        time.sleep(1.0)
        group = dist.group.WORLD  # a plain torch.distributed job: the pipeline is the world
    started = time.monotonic()
    try:
        training_log(1, cfg, pp_group=group)
        seen["error"] = None
    except Exception as error:  # what the user sees
        seen["error"] = f"{type(error).__name__}: {error}"
    seen["seconds"] = time.monotonic() - started
    Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def launch(scenario: str, out: Path) -> dict[int, dict]:
    from nemo_memlog.testing.cluster import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), __file__, scenario, str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    found = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert found, done.stdout[-3000:] + done.stderr[-3000:]
    return found


def test_torchrun_without_a_process_group_is_refused_with_the_fix(tmp_path):
    seen = launch("no_group", tmp_path)
    assert sorted(seen) == [0, 1]
    for rank, entry in seen.items():
        error = entry["error"] or ""
        assert error.startswith("RuntimeError: nemo_memlog: WORLD_SIZE=2 and RANK=") and f"RANK={rank}" in error
        assert "torch.distributed is not initialised" in error
        assert "Call torch.distributed.init_process_group()" in error and "before the first training_log" in error


def test_a_peer_that_left_is_named_as_such_not_as_a_timeout(tmp_path):
    seen = launch("one_rank", tmp_path)
    assert sorted(seen) == [1]
    error, seconds = seen[1]["error"] or "", seen[1]["seconds"]
    assert error.startswith("MemoryReduceError: memory reduction over ") and "a peer left after " in error, error
    assert "Connection closed by peer" in error or "Connection reset by peer" in error, error
    assert "not every rank joined" not in error and seconds < TIMEOUT_S / 4, (seconds, error)
    assert "nemo-memlog postmortem" in error


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[1:]))
