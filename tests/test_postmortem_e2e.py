"""End to end: real ranks under torchrun (PP 4 over gloo; megatron-core's parallel_state
builds the groups in the SIGKILL run, plain torch.distributed in the others) record their
memory with training_log; ``nemo-memlog postmortem --json`` then reads the folder they left.

- ``sigkill``: rank VICTIM stalls for HANG_S at the start of iteration KILL_AT (a rank
  swapping before the OOM killer strikes) and then SIGKILLs itself (the OOM killer's death:
  no end marker). The others record KILL_AT and block in its collective meanwhile; when the
  victim dies, gloo fails their collective (or torchrun stops them).
- ``clean`` and ``sigterm`` are not launched here. A clean end's post-mortem over real ranks:
  tests/test_demo.py (4 ranks "closed by the run"), test_lightning.py and test_megatron_lm.py; each
  way a process ends (close, exit, exception, SIGTERM, SIGKILL), its end marker:
  tests/test_recorder.py. tests/test_sigterm.py SIGTERMs the demo under torchrun and runs the
  post-mortem on it.

This file is also the rank script: ``torchrun tests/test_postmortem_e2e.py SCENARIO ROOT``.
One torchrun launch per scenario.
"""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.readback import postmortem

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
VICTIM = 2
KILL_AT = 6
HANG_S = 2.5
STEPS = 5
REDUCE_TIMEOUT_S = 4.0
LAUNCH_TIMEOUT_S = 180  # a loaded 2-core machine: four ranks import torch and megatron-core


# ---- the rank script ------------------------------------------------------------------------


def rank_main(scenario: str, root: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from nemo_memlog import LoggerConfig, close_writers, training_log

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pp_group = dist.group.WORLD  # clean, sigterm: a plain torch.distributed job, PP group = world
    if scenario == "sigkill":  # megatron-core builds the groups, and the recorder reads them there
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=WORLD)
        pp_group = None
    rank = dist.get_rank()
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        memory_record_dir=f"{root}/memory_records",
        memory_reduce_timeout_s=REDUCE_TIMEOUT_S,
        writer_mode="thread",
    )
    iteration = 0
    while scenario == "sigterm" or iteration < (KILL_AT + 100 if scenario == "sigkill" else STEPS):
        iteration += 1
        if scenario == "sigkill" and rank == VICTIM and iteration == KILL_AT:
            time.sleep(HANG_S)  # mid-iteration: the step before was recorded, this one never will be
            os.kill(os.getpid(), signal.SIGKILL)
        training_log(iteration, cfg, pp_group=pp_group)
        time.sleep(0.05)
    if rank != WORLD - 1:
        close_writers()  # the last rank exits without: atexit marks its record
    dist.destroy_process_group()
    return 0


# ---- the tests ------------------------------------------------------------------------------


def launch(root: Path, scenario: str):
    """torchrun with WORLD ranks of this script, run to its end: (exit status, its output)."""
    from nemo_memlog.testing import torchrun

    done = torchrun.run(
        __file__,
        scenario,
        root,
        nproc=WORLD,
        monitor_interval=2,
        env={"PYTHONUNBUFFERED": "1"},
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigkill")
    returncode, output = launch(root, "sigkill")
    return root, returncode, output


def test_sigkill_names_the_killed_rank_first(killed):
    root, returncode, output = killed
    assert returncode != 0, output
    status, found = postmortem(root)  # the run folder above memory_records: the command searches below
    assert status == 1, found
    first = found["first_failure"]
    assert first is not None, found
    assert (first["rank"], first["status"], first["last_iteration"]) == (VICTIM, "unfinished", KILL_AT - 1), found
    assert first["pp_rank"] == VICTIM and first["end_reason"] is None
    ranks = {entry["rank"]: entry for entry in found["ranks"]}
    assert sorted(ranks) == list(range(WORLD))
    assert [ranks[r]["pp_rank"] for r in range(WORLD)] == list(range(WORLD))  # megatron's PP 4: pp rank = rank
    for rank in set(ranks) - {VICTIM}:
        survivor = ranks[rank]
        # Each survivor recorded the iteration the victim never reached, then blocked in its
        # collective until the reduction raised or torchrun's SIGTERM stopped it: an end of its own.
        assert survivor["last_iteration"] == KILL_AT, survivor
        assert survivor["end_reason"] in ("exception", "sigterm"), survivor
        assert survivor["status"] == "closed", survivor
    assert found["failed_ranks"][0] == VICTIM and found["world_size"] == WORLD


def test_sigkill_survivors_kept_beating_while_blocked(killed):
    """The liveness thread beats while the training thread waits in gloo: the survivors, blocked
    in the collective while the victim stalled, were seen alive long after their last step record."""
    from tests.readback import read_back

    root, _, _ = killed
    waited = []
    for path in sorted((root / "memory_records").glob("rank-*.memrec")):
        header, liveness, found = read_back(path)
        if header["rank"] != VICTIM:
            waited.append(liveness["alive"] - max(r["time"] for r in found if r["kind"] == "step"))
    assert len(waited) == WORLD - 1 and min(waited) >= HANG_S / 2, waited


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[1:]))
