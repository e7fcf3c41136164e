"""A launcher's teardown loses no logged step. torchrun starts the demo's 4 ranks, all four backends
in the default writer process, inside a memory cgroup of their own (the job step's, as SLURM makes
it). Rank 0 is SIGKILLed, as the kernel's OOM killer would, either before the backends have opened
(two steps in: the writer process is still importing them) or after (TensorBoard holds steps).
torchrun then tears the job down as it always does (SIGTERM to every worker's process group, SIGKILL
30 s later), and the moment torchrun exits every process left in the cgroup is SIGKILLed, as SLURM
and Kubernetes end a step. Every step the writer rank's training_log returned must then be in
TensorBoard, in MLflow (read with its own client: the store must not be half-created), in the W&B
run's records and in the Comet archive."""

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from nemo_memlog.testing import cgroups, torchrun
from nemo_memlog.testing.wait import wait_for
from tests.readback import stored_steps, tensorboard_steps

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
JOB_LIMIT = 16_000_000_000  # roomy: this cgroup is the job's boundary, not a memory limit under test


def _progress(lines) -> int:
    done = [int(m.group(1)) for line in lines for m in re.finditer(r"\b(\d+)/100000\b", line)]
    return max(done, default=0)


def _rank_zero(group) -> int | None:
    """The pid of the demo's rank 0 in ``group`` (its environment says RANK=0)."""
    for pid in group.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"demo.py" in cmdline and b"RANK=0" in environ and b"torch.distributed.run" not in cmdline:
            return pid
    return None


@pytest.fixture(
    scope="module",
    params=["before_the_backends_opened", "after_the_backends_opened", "after_the_backends_opened-thread"],
)
def torn_down(request, tmp_path_factory):
    ok, why = cgroups.available()
    if not ok:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    root = tmp_path_factory.mktemp("teardown")
    run = root / "job"
    env = {"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    args = ["train.iters=100000", "logger.tensorboard_log_interval=1", f"run.root={root}", "run.name=job"]
    args += ["train.save_every=0", "train.micro_batch_size=4", "train.seq_len=16"]
    if request.param.endswith("-thread"):  # the backends in threads of the writer rank's own process
        args += ["logger.writer_mode=thread"]
    lines: list[str] = []
    with cgroups.memory_cgroup(JOB_LIMIT) as group:
        proc = torchrun.start(
            ROOT / "scripts" / "demo.py",
            *args,
            nproc=4,
            env=env,
            cgroup=group,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=_read_into, args=(proc.stderr, lines), daemon=True).start()
        try:
            if request.param.startswith("before"):
                wait_for(lambda: _progress(list(lines)) >= 2, 150, "two logged steps", proc=proc)
            else:
                wait_for(lambda: len(tensorboard_steps(run)) >= 6, 150, "six steps in TensorBoard", proc=proc)
            victim = _rank_zero(group)
            assert victim is not None, "rank 0 not found in the job's cgroup"
            os.kill(victim, signal.SIGKILL)
            proc.wait(timeout=150)  # torchrun's own teardown: SIGTERM, then SIGKILL after 30 s
        finally:
            torchrun.kill_group(proc)
            left = group.kill_all()  # torchrun has exited: SLURM ends whatever is left in the step
    return run, left, lines


def _read_into(stream, lines):
    for line in iter(stream.readline, ""):
        lines.extend(re.split(r"[\r\n]", line))


def test_every_step_training_log_returned_is_in_every_backend(torn_down):
    from tests.test_postmortem_e2e import postmortem

    run, left, lines = torn_down
    _, found = postmortem(run / "memory_records")
    assert found["first_failure"]["rank"] == 0, found["sentence"]
    writer = next(r for r in found["ranks"] if r["rank"] == 3)
    last = writer["last_iteration"]  # recorded before its gather: returned up to it, or up to the one before
    assert last and last >= 2, writer
    stored = stored_steps(run)
    for backend, steps in stored.items():
        missing = set(range(1, last)) - steps
        assert not missing, f"{backend} lost steps {sorted(missing)} of 1..{last - 1} ({len(steps)} stored)"
        assert steps <= set(range(1, last + 1)), f"{backend} holds steps never logged: {sorted(steps)}"
