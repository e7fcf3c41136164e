"""A launcher's teardown loses no logged step. torchrun starts a job inside a memory cgroup of its
own (the job step's, as SLURM makes it), its last rank the writer rank, with all four backends.
Rank 0 is SIGKILLed, as the kernel's OOM killer would, either before the backends have opened (a
couple of steps handed, the writer process just started, its interpreter still starting or
importing them: TensorBoard opens after the kill; torchrun's SIGTERM then reaches the writer
process in its start-up, which must hold it) or after (TensorBoard holds steps). torchrun
then tears the job down as it always does (SIGTERM to every worker's process group, SIGKILL 30 s
later), and the moment its launcher exits every process left in the cgroup is SIGKILLed, as SLURM
and Kubernetes end a step. Every step the writer rank's training_log returned must then be in
TensorBoard, in MLflow (read with its own client: the store must not be half-created), in the W&B
run's records and in the Comet archive, and none may hold a step never logged.

Two cases run tests/trainer.py (2 ranks; rank 1, the writer rank, prints ``handed <step>`` once
each call has returned): before the backends opened, in the default writer process; after, in
threads of the writer rank (``--mode thread``), once every backend has written a step (the trainer
prints the fan-out's counts: a backend's start-up under load is not what this case tests), with
MLflow's server a black hole that no close can wait for. The third, after, in the writer process, runs the
demo (megatron-core, PP 2: 2 ranks, half the start-up of the default 4), which also stands for its
failure demo (``python scripts/demo.py fail.kill_stage=0``): the post-mortem command rank 0 printed
at start, pasted as a user would, tells one story, rank 0 vanished first and the other rank died of
its loss. Rank 0 is SIGKILLed from outside in every case: the demo's own fail.kill_at counts
iterations, and how many pass before the writer process (at nice +10) has opened TensorBoard
varies from a few to over 30 with the machine's load.
"""

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from nemo_memlog.testing import cgroups, torchrun
from nemo_memlog.testing.wait import wait_for
from tests.readback import mlflow_rows_so_far, stored_steps, tensorboard_steps

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "trainer.py"
JOB_LIMIT = 16_000_000_000  # roomy: this cgroup is the job's boundary, not a memory limit under test


def _rank_zero(group, script: bytes) -> int | None:
    """The pid of ``script``'s rank 0 in ``group`` (its environment says RANK=0)."""
    for pid in group.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if script in cmdline and b"RANK=0" in environ and b"torch.distributed.run" not in cmdline:
            return pid
    return None


def _handed(out: Path) -> list[int]:
    """The steps the writer rank's training_log returned, as the trainer printed them."""
    return [int(line.split()[1]) for line in out.read_text().splitlines() if re.fullmatch(r"handed \d+", line)]


def _opened(out: Path, at_least: dict[str, int]) -> bool:
    """Whether the thread-mode trainer's last ``written`` line shows each backend of ``at_least`` with at
    least that many steps written."""
    lines = [line for line in out.read_text().splitlines() if line.startswith("written ")]
    written = dict(pair.split("=") for pair in lines[-1].split()[1:]) if lines else {}
    return all(int(written.get(name, 0)) >= count for name, count in at_least.items())


def _tensorboard_opened(run: Path) -> float | None:
    """When TensorBoard opened its first event file (the wall time of the file's first event), or
    None if it never did (the test of every backend then says which steps are lost)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = (run / "tensorboard").rglob("events.out.tfevents.*")
    return min((next(iter(EventFileLoader(str(events)).Load())).wall_time for events in files), default=None)


def _writer_pid(out: Path) -> int | None:
    """The writer process's pid, as the trainer printed it (``trainer <pid> writer <pid>``)."""
    found = re.search(r"^trainer \d+ writer (\d+)$", out.read_text(), re.MULTILINE)
    return int(found.group(1)) if found else None


def trainer_torn_down(root: Path, case: str) -> dict:
    """tests/trainer.py on 2 ranks, all four backends, until rank 0 is SIGKILLed from outside. In
    thread mode MLflow's server never answers (a slow backend at its extreme: the machine's speed
    decides nothing), and the close budget is within torchrun's 30 s."""
    run, out, err = root / "job", root / "stdout", root / "stderr"
    mode = "thread" if case.endswith("-thread") else "process"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    hung = socket.create_server(("127.0.0.1", 0))  # connections queue, never answered
    extra = ["--mlflow-uri", f"http://127.0.0.1:{hung.getsockname()[1]}", "--close-timeout", "20"]
    # Files, not pipes: the writer process shares them, and would hold a pipe open.
    with hung, cgroups.memory_cgroup(JOB_LIMIT) as group, open(out, "w") as stdout, open(err, "w") as stderr:
        args = ["--steps", "0", "--mode", mode, *(extra if mode == "thread" else [])]
        proc = torchrun.start(TRAINER, run, *args, nproc=2, env=env, cgroup=group, stdout=stdout, stderr=stderr)
        try:
            if case.startswith("before"):
                # As early as the writer process can be: started at step 1, its interpreter still
                # starting or importing its backends (it holds the launcher's SIGTERM from its fork on).
                def started() -> bool:
                    return len(_handed(out)) >= 2 and _writer_pid(out) is not None

                what = "two steps handed, the writer process started"
                wait_for(started, 150, what, proc=proc, detail=err.read_text, interval_s=0.01)
            elif mode == "thread":  # every backend open but the hung one, however long their start-up takes
                opened = "every backend but MLflow opened, six steps in TensorBoard"
                wait_for(lambda: _opened(out, {"tensorboard": 6, "wandb": 1, "comet": 1}), 300, opened, proc=proc)
            else:  # after the backends opened (see demo_killed)
                wait_for(
                    lambda: len(tensorboard_steps(run)) >= 6 and mlflow_rows_so_far(run) >= 1,
                    150,
                    "six steps in TensorBoard and one in MLflow",
                    proc=proc,
                )
            victim = _rank_zero(group, b"trainer.py")
            assert victim is not None, "rank 0 not found in the job's cgroup"
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            proc.wait(timeout=150)  # torchrun's own teardown: SIGTERM, then SIGKILL after 30 s
        finally:
            torchrun.kill_group(proc)
            group.kill_all()  # torchrun has exited: SLURM ends whatever is left in the step
    handed = _handed(out)
    assert handed == list(range(1, len(handed) + 1)) and len(handed) >= 2, (handed[-5:], err.read_text()[-3000:])
    if case.startswith("before"):
        opened = _tensorboard_opened(run)
        print(f"{case}: rank 0 SIGKILLed at step {len(handed)} at {killed_at}; TensorBoard opened at {opened}")
        assert opened is None or opened > killed_at, "TensorBoard had opened before rank 0 was killed"
    torn = {"run": run, "returned": set(handed), "logged": set(range(1, len(handed) + 2))}
    if mode == "thread":  # MLflow stored nothing, and said so; the others did not wait for it
        assert re.search(r"nemo_memlog: mlflow did not store \d+ of the \d+ logged steps", err.read_text())
        torn["hung"] = {"mlflow"}
    # A call cut short after it handed its step over (and before its print) logged one more.
    return torn


def demo_killed(root: Path) -> dict:
    """The demo (2 ranks, PP 2) under torchrun, all four backends in the writer process, until rank 0
    is SIGKILLed from outside once TensorBoard holds six steps and MLflow one."""
    run = root / "job"
    env = {"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    args = ["train.iters=100000", "logger.tensorboard_log_interval=1", f"run.root={root}", "run.name=job"]
    args += ["train.save_every=0", "train.micro_batch_size=4", "train.seq_len=16", "parallel.pp=2"]
    lines: list[str] = []
    with cgroups.memory_cgroup(JOB_LIMIT) as group:
        proc = torchrun.start(
            ROOT / "scripts" / "demo.py",
            *args,
            nproc=2,
            env=env,
            cgroup=group,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=_read_into, args=(proc.stderr, lines), daemon=True).start()
        try:
            # After the backends opened: TensorBoard holds six steps and MLflow's SQLite store one (its
            # open, migrations included, took 15 s and more on 2 loaded cores: a kill during it is not this case).
            wait_for(
                lambda: len(tensorboard_steps(run)) >= 6 and mlflow_rows_so_far(run) >= 1,
                150,
                "six steps in TensorBoard and one in MLflow",
                proc=proc,
            )
            victim = _rank_zero(group, b"demo.py")
            assert victim is not None, "rank 0 not found in the job's cgroup"
            os.kill(victim, signal.SIGKILL)
            proc.wait(timeout=150)  # torchrun's own teardown: SIGTERM, then SIGKILL after 30 s
        finally:
            torchrun.kill_group(proc)
            group.kill_all()  # torchrun has exited: SLURM ends whatever is left in the step
    return {"run": run, "stderr": list(lines)}


def _read_into(stream, lines: list[str]) -> None:
    for line in iter(stream.readline, ""):
        lines.extend(re.split(r"[\r\n]", line))


@pytest.fixture(scope="module")
def killed_demo(tmp_path_factory):
    ok, why = cgroups.available()
    if not ok:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    return demo_killed(tmp_path_factory.mktemp("teardown"))


@pytest.fixture(
    scope="module",
    params=["before_the_backends_opened", "after_the_backends_opened", "after_the_backends_opened-thread"],
)
def torn_down(request, tmp_path_factory):
    """{"run": the run folder, "returned": the steps training_log returned on the writer rank,
    "logged": the steps it may have handed over}."""
    ok, why = cgroups.available()
    if not ok:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    if request.param != "after_the_backends_opened":
        return trainer_torn_down(tmp_path_factory.mktemp("teardown"), request.param)
    from tests.readback import postmortem

    demo = request.getfixturevalue("killed_demo")
    _, found = postmortem(demo["run"] / "memory_records")
    assert found["first_failure"]["rank"] == 0, found["sentence"]
    writer = next(r for r in found["ranks"] if r["rank"] == 1)
    last = writer["last_iteration"]  # recorded before its gather: returned up to it, or up to the one before
    assert last and last >= 2, writer
    return {"run": demo["run"], "returned": set(range(1, last)), "logged": set(range(1, last + 1))}


def test_every_step_training_log_returned_is_in_every_backend(torn_down):
    run, returned, logged = torn_down["run"], torn_down["returned"], torn_down["logged"]
    for backend, steps in stored_steps(run, skip=torn_down.get("hung", ())).items():
        missing = returned - steps
        assert not missing, f"{backend} lost steps {sorted(missing)} of {len(returned)} returned ({len(steps)} stored)"
        assert steps <= logged, f"{backend} holds steps never logged: {sorted(steps - logged)}"


def test_the_killed_demos_post_mortem_tells_one_story(killed_demo):
    """The command rank 0 printed at start for after a failure, pasted as a user would, names rank 0
    first and every other rank as its loss's (what ``python scripts/demo.py fail.kill_stage=0`` shows)."""
    from tests.commands import run_as_printed

    printed = [m for line in killed_demo["stderr"] for m in re.findall(r"\(after a failure: (.+)\)$", line)]
    (command,) = set(printed)
    assert str(killed_demo["run"] / "memory_records") in command
    done = run_as_printed(command)
    assert done.returncode == 1, (done.stdout[-3000:], done.stderr[-2000:])
    text = done.stdout
    assert "FIRST FAILURE: rank 0 (pp stage 0, tp 0, dp 0)" in text and "vanished" in text
    assert "died of rank 0's loss (1): rank 1," in text
    assert "cannot tell" not in text and "from outside" not in text
