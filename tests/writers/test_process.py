"""The writer process, for real: trainers killed with SIGKILL or ending with os._exit, a hung
backend, a stopped and a killed writer process, host memory, and what /proc shows of it.

Trainers are tests/trainer.py (alone, or two ranks under torchrun); their runs are read
back with tests/readback.py, as the SIGTERM test reads the demo's.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nemo_memlog import LoggerConfig, build_writers
from nemo_memlog.testing import torchrun
from nemo_memlog.testing.notices import said
from nemo_memlog.testing.wait import alive, descendants, returns_within, seconds_until, wait_for
from nemo_memlog.writers import child, parent
from tests.readback import mlflow_rows_so_far, stored_steps, tensorboard_steps, wandb_finished

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "tests" / "trainer.py"
SECRET = "SECRET-WRITER-KEY"
GONE_CLOSE_BUDGET_S = 300.0  # the close of a writer process already killed: never waited out


def _seconds_until_gone(pids, timeout_s: float) -> float:
    """Seconds until none of ``pids`` runs; fails the test after ``timeout_s``."""
    return seconds_until(lambda: not any(alive(pid) for pid in pids), timeout_s, "the processes' end",
                         detail=lambda: f"still running: {[p for p in pids if alive(p)]}", interval_s=0.05)  # fmt: skip


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP): its state in /proc/PID/stat is T."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


def _trainer_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _run_trainer(run: Path, *args) -> dict:
    done = subprocess.run(
        [sys.executable, str(TRAINER), str(run), *args],
        cwd=ROOT,
        env=_trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_trainers(runs: dict) -> dict:
    """_run_trainer for each of ``runs`` ({name: its arguments}), all at once: much of a
    trainer's time is waiting on its backends, and the others' start-up fills it. Output goes
    to files: a pipe not read while another trainer is awaited could fill and stall it."""
    env, started = _trainer_env(), {}
    for name, args in runs.items():
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            [sys.executable, str(TRAINER), *map(str, args)], cwd=ROOT, env=env, stdout=out, stderr=err
        )
        started[name] = (proc, out, err)
    results = {}
    for name, (proc, out, err) in started.items():
        with out, err:
            proc.wait(timeout=300)
            out.seek(0), err.seek(0)
            assert proc.returncode == 0, err.read()[-3000:]
            results[name] = json.loads(out.read().strip().splitlines()[-1])
    return results


@pytest.mark.processes
def test_sigkill_of_the_trainer_loses_no_handed_step_and_leaves_no_process(tmp_path):
    """Two ranks under torchrun; the writer rank's training process is SIGKILLed mid-run."""
    run, close_s = tmp_path / "killed", 20
    out_path = tmp_path / "stdout"
    with open(out_path, "w") as out, open(tmp_path / "stderr", "w") as err:
        job = torchrun.start(
            TRAINER,
            run,
            "--steps",
            "0",
            "--close-timeout",
            close_s,
            nproc=2,
            env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
            stdout=out,
            stderr=err,
        )

    def handed_so_far() -> int:
        lines = out_path.read_text().splitlines()
        return max([int(line.split()[1]) for line in lines if line.startswith("handed ")], default=0)

    try:
        # Mid-run, every backend open and writing (the property: handed steps are not lost to the kill).
        # A store still opening when the trainer dies gets the close budget like the others, and says
        # which steps it did not store (fanout.py); under a loaded suite MLflow's SQLite open with its
        # migrations, at the writer's nice +10, outlasted the 20 s budget: 0 of 168 stored.
        wait_for(
            lambda: handed_so_far() >= 25 and list(run.glob("wandb/offline-run-*")) and mlflow_rows_so_far(run) >= 1,
            180,
            "25 steps handed over, a W&B run and a step in MLflow",
            proc=job,
            detail=lambda: (tmp_path / "stderr").read_text()[-3000:],
        )
        handed, lines = handed_so_far(), out_path.read_text().splitlines()
        (ids,) = [line.split() for line in lines if line.startswith("trainer ")]
        trainer, writer = int(ids[1]), int(ids[3])
        ours = set(descendants(job.pid))
        assert {trainer, writer} <= ours
        os.kill(trainer, signal.SIGKILL)  # as the OOM killer does: this one process, nothing else
        writer_exit_s = _seconds_until_gone([writer], close_s + 10)
        _seconds_until_gone(ours | {job.pid}, close_s + 60)  # torchrun ends rank 0 and itself
    finally:
        torchrun.kill_group(job)
    stored = stored_steps(run)
    print(
        f"SIGKILL after {handed} steps handed over; the writer process ended {writer_exit_s:.1f} s later; "
        f"steps stored: { ({backend: len(steps) for backend, steps in stored.items()}) }"
    )
    for backend, steps in stored.items():
        missing = set(range(1, handed + 1)) - steps
        assert not missing, f"{backend} lost steps {sorted(missing)} of the {handed} handed over before the kill"
    assert wandb_finished(run), "the W&B run was not finished"
    # Its promise: the close budget, then its watchdog's grace; it learns of the death from the socket's
    # end, or within a poll of its parent. A close that used its whole budget under load (all stored,
    # W&B finished) ended 20.4 s after the kill in CI.
    assert writer_exit_s < close_s + child.EXIT_GRACE_S + child.PARENT_POLL_S, "the writer outlived its close budget"


@pytest.mark.processes
def test_the_writer_rank_holds_no_backend_memory(tmp_path):
    """Host RSS of the trainer after 20 logged steps, all written to the four backends."""
    memory = _run_trainers({mode: (tmp_path / mode, "--mode", mode) for mode in ("off", "process", "thread")})
    print("host memory (MB):", memory)
    for key in ("rss_mb", "peak_rss_mb"):
        assert abs(memory["process"][key] - memory["off"][key]) < 30, (key, memory)
        # The same measurement sees the backends when they do live in the trainer:
        assert memory["thread"][key] - memory["off"][key] > 60, (key, memory)
    for backend, steps in stored_steps(tmp_path / "process").items():
        assert steps == set(range(1, 21)), backend
    assert not alive(memory["process"]["writer_pid"]), "closing reaps the writer process"


@pytest.mark.processes
def test_a_dead_trainer_and_a_hung_backend_leave_no_writer_process_behind(tmp_path):
    """os._exit in the trainer while MLflow's server never answers: TensorBoard still gets
    closed, the writer process ends within writer_close_timeout_s, and its warnings still
    reach the console."""
    run, close_s = tmp_path / "exited", 3
    with socket.create_server(("127.0.0.1", 0)) as black_hole:  # connections queue, never answered
        uri = f"http://127.0.0.1:{black_hole.getsockname()[1]}"
        # Files, not pipes: the writer process shares them, and would hold a pipe open.
        with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
            subprocess.run(
                [
                    sys.executable,
                    str(TRAINER),
                    str(run),
                    "--backends",
                    "tensorboard,mlflow",
                    "--mlflow-uri",
                    uri,
                    "--wait-for",
                    "tensorboard",
                    "--steps",
                    "10",
                    "--close-timeout",
                    str(close_s),
                    "--end",
                    "os_exit",
                ],
                cwd=ROOT,
                env=_trainer_env(),
                stdout=out,
                stderr=err,
                timeout=300,
                check=True,
            )
        writer = json.loads((tmp_path / "stdout").read_text().strip().splitlines()[-1])["writer_pid"]
        # A writer that waited on the hung server would take MLflow's own HTTP timeouts (minutes): past this.
        exit_s = _seconds_until_gone([writer], 60)  # from the trainer's end
    # Its promise, as in the SIGKILL test: the close budget, then its watchdog's grace (a parent poll
    # at most to learn of the death; here the socket's end says it at once).
    assert exit_s < close_s + child.EXIT_GRACE_S + child.PARENT_POLL_S, exit_s
    assert tensorboard_steps(run) == set(range(1, 11))
    assert "nemo_memlog: mlflow backend: did not finish closing in time" in (tmp_path / "stderr").read_text()


@pytest.mark.processes
def test_no_secret_in_the_writer_process_command_line_or_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("COMET_API_KEY", SECRET)
    monkeypatch.setenv("DEPLOY_NOTE", f"the key is {SECRET}")  # a secret under a harmless name
    monkeypatch.setattr(sys, "argv", ["pretrain.py", f"logger.comet_api_key={SECRET}"])
    cfg = LoggerConfig(tensorboard_dir=str(tmp_path / "tb"), comet_api_key=SECRET)
    fanout = build_writers(cfg)
    try:
        fanout.log({"memory/peak_host_rss_gb": 1.0}, 1)
        assert fanout.flush(120)  # the writer process runs, has read the secrets, has written
        with open(f"/proc/{fanout.pid}/cmdline", "rb") as cmdline, open(f"/proc/{fanout.pid}/environ", "rb") as env:
            argv, environ = cmdline.read(), env.read()
    finally:
        fanout.close()
    assert argv.split(b"\0")[1:3] == [b"-m", b"nemo_memlog.writers.child"]
    assert SECRET.encode() not in argv and SECRET.encode() not in environ
    names = {entry.split(b"=", 1)[0] for entry in environ.split(b"\0")}
    assert b"PATH" in names and b"COMET_API_KEY" not in names and b"DEPLOY_NOTE" not in names
    assert [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()] == []


def test_secret_variables_go_through_the_socket():
    public, private = parent.split_environment(
        {"PATH": "/bin", "WANDB_API_KEY": "k1", "MLFLOW_TRACKING_TOKEN": "k2", "NOTE": f"x{SECRET}y"}, [SECRET]
    )
    assert public == {"PATH": "/bin"}
    assert private == {"WANDB_API_KEY": "k1", "MLFLOW_TRACKING_TOKEN": "k2", "NOTE": f"x{SECRET}y"}


@pytest.mark.processes
def test_a_stopped_or_killed_writer_process_never_holds_up_training(tmp_path, monkeypatch):
    monkeypatch.setattr(parent, "SEND_BUFFER", 64 * 1024)  # a small socket fills in fewer steps
    cfg = LoggerConfig(tensorboard_dir=str(tmp_path / "tb"), writer_buffer_steps=10)
    padding = {f"pad/{i}": 0.0 for i in range(40)}
    with said(warned=False) as caught:
        fanout = build_writers(cfg)
        fanout.log({"x": 0.0}, 0)
        assert fanout.flush(120)
        os.kill(fanout.pid, signal.SIGSTOP)  # stuck: reads nothing
        wait_for(lambda: _stopped(fanout.pid), 30, "the writer process stopped")

        def hand_off_200_steps() -> int:
            for step in range(1, 201):
                fanout.log({"x": float(step), **padding}, step)
            return fanout.dropped

        try:
            # The training thread never waits for the writer process: a log that waited on it (a
            # blocking send once the socket is full) would never return while it is stopped.
            dropped_here = returns_within(hand_off_200_steps, 60, "200 steps handed over")
            assert _stopped(fanout.pid), "every hand-off returned while the writer process was stopped"
        finally:
            os.kill(fanout.pid, signal.SIGCONT)
        assert fanout.flush(60)
        stats = fanout.stats()["tensorboard"]
        os.kill(fanout.pid, signal.SIGKILL)  # gone
        wait_for(lambda: any("writer process ended unexpectedly" in w for w in caught), 30, "the notice of its end")
        for step in range(201, 206):
            fanout.log({"x": float(step)}, step)  # never raises
        # The writer process is gone: a close that waited out its budget would still run at this deadline.
        returns_within(lambda: fanout.close(timeout_s=GONE_CLOSE_BUDGET_S), 60, "the close without a writer process")
    messages = [w for w in caught]
    assert 0 < dropped_here < 200 and stats["pending"] == 0
    assert stats["written"] + stats["dropped"] == 201, stats  # every step written or counted
    assert len([m for m in messages if "the writer process is behind" in m]) == 1
    assert len([m for m in messages if "writer process ended unexpectedly" in m]) == 1
    assert fanout.dropped == dropped_here + 5


@pytest.mark.processes
def test_where_no_process_can_start_the_backends_run_in_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))  # starting it fails for real
    with said(warned=False) as caught:
        fanout = build_writers(LoggerConfig(tensorboard_dir=str(tmp_path / "tensorboard")))
        fanout.log({"memory/peak_host_rss_gb": 1.5}, 3)
        fanout.close()
    assert not isinstance(fanout, parent.ProcessFanOut)
    assert len([w for w in caught if "could not start the writer process" in w]) == 1
    assert tensorboard_steps(tmp_path) == {3}
