"""SIGTERM mid-run (a preemption, a SLURM time limit): the demo under torchrun (PP 2, two ranks) is signalled,
and every step training_log returned before the signal is in all four backends."""

import os
import re
import signal
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from nemo_memlog.offline.tables import size_text
from nemo_memlog.testing import torchrun
from nemo_memlog.testing.wait import wait_for
from tests.readback import main_run_events, stored_steps, wandb_finished

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _progress(stderr_lines):
    """The highest iteration tqdm showed as finished ('  7/100000')."""
    done = [int(m.group(1)) for line in stderr_lines for m in re.finditer(r"\b(\d+)/100000\b", line)]
    return max(done, default=0)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The demo under torchrun, SIGTERM'd mid-run: (its run directory, iterations tqdm showed done)."""
    tmp_path = tmp_path_factory.mktemp("preempted")
    proc = torchrun.start(
        ROOT / "scripts" / "demo.py",
        "train.iters=100000",
        "logger.tensorboard_log_interval=1",
        f"run.root={tmp_path}",
        "run.name=preempted",
        "train.micro_batch_size=4",
        "train.seq_len=16",
        "parallel.pp=2",  # two stages are enough for every rank closed by SIGTERM, at half the ranks' start-up
        "logger.comet_api_key=SECRET-ARGV-KEY",
        nproc=2,
        env={"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=_read_into, args=(proc.stderr, lines), daemon=True).start()
    try:
        wait_for(
            lambda: _progress(list(lines)) >= 6,
            180,
            "six iterations done before the signal",
            proc=proc,
            detail=lambda: "\n".join(list(lines)[-30:]),
        )
        finished = _progress(list(lines))
        os.killpg(proc.pid, signal.SIGTERM)  # like SLURM: torchrun and every rank at once
        proc.wait(timeout=120)
    finally:
        torchrun.kill_group(proc)
    return tmp_path / "preempted", finished, lines


def test_sigterm_mid_run_keeps_every_returned_step_in_every_backend(preempted):
    run, finished, _ = preempted
    for backend, steps in stored_steps(run).items():
        # Every iteration tqdm showed as finished had returned from training_log (interval 1).
        missing = set(range(1, finished + 1)) - steps
        assert not missing, f"{backend} lost steps {sorted(missing)} (has {len(steps)} steps)"
    assert wandb_finished(run)


def test_a_secret_on_the_command_line_reaches_no_backend_file(preempted):
    run, _, _ = preempted
    scanned = 0
    for path in run.rglob("*"):
        if path.is_file():
            scanned += 1
            assert b"SECRET-ARGV-KEY" not in path.read_bytes(), path
        if path.suffix == ".zip":  # the Comet archive is compressed: look inside
            with zipfile.ZipFile(path) as archive:
                assert not any(b"SECRET-ARGV-KEY" in archive.read(name) for name in archive.namelist())
    assert scanned >= 4  # TensorBoard events, MLflow store, W&B run, Comet archive at least


def test_report_on_the_real_run_directory(preempted, capsys):
    """The report command on what a real multi-process run wrote (a copy off a cluster would do)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nemo_memlog.cli import main
    from tests.readback import png_size

    run, _, _ = preempted
    (events,) = main_run_events(run / "tensorboard")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    last = {tag: accumulator.Scalars(tag)[-1].value for tag in accumulator.Tags()["scalars"]}
    per_stage = [last[f"memory/pp_stage_{i}/peak_host_rss_gb"] for i in range(2)]
    assert last["memory/peak_stage/peak_host_rss_gb"] == per_stage.index(max(per_stage))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    # The first block's row (a wide table, phase and model-state rows included, wraps into blocks).
    row = next(line for line in out.splitlines() if line.startswith("peak_host_rss_gb"))
    assert size_text(max(per_stage)) in row and "pipeline stages: 2" in out
    assert "peak window: run (each peak_* point is the peak since its process started)" in out  # the default
    (width, height), size = png_size(run / "memory_report.png")
    assert width >= 400 and height >= 300 and size > 10_000


def test_the_post_mortem_of_the_preempted_run_finds_every_rank_closed_by_sigterm(preempted):
    """Our SIGTERM handler marks every rank's flight record ended ("sigterm"), so the post-mortem
    of a preempted job reports no failure (exit status 0) and every rank's last iteration."""
    from tests.readback import postmortem

    run, finished, _ = preempted
    status, found = postmortem(run)
    assert status == 0 and found["first_failure"] is None, found
    assert [(r["rank"], r["status"], r["end_reason"]) for r in found["ranks"]] == [
        (rank, "closed", "sigterm") for rank in range(2)
    ], found
    assert min(r["last_iteration"] for r in found["ranks"]) >= finished


def _read_into(stream, lines):
    # tqdm redraws with carriage returns: split on them to see every update.
    for line in iter(stream.readline, ""):
        lines.extend(re.split(r"[\r\n]", line))


def test_the_backends_info_lines_stay_out_of_the_progress_bar(preempted):
    # MLflow announced creating its tables and Comet its archiving on the console, between
    # tqdm's redraws; the demo turns both down to warnings (all four backends run here).
    _, _, lines = preempted
    chatter = [line for line in lines if "COMET INFO" in line or re.search(r"\bINFO mlflow", line)]
    assert not chatter, chatter


LATE_SIGTERM = """
import os, signal, socket, sys
import torch.distributed as dist
from nemo_memlog import process_wide
from nemo_memlog.warn import notice

with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)  # torch's excepthook
process_wide.on_sigterm(lambda: notice("nemo_memlog: mlflow did not store 3 of the 3 logged steps: steps 1-3"))

class PeerLeft(Exception):
    def __str__(self):  # formatted inside torch's excepthook, sys.stderr an in-memory buffer meanwhile
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM, 0.1 s after the rank's error
        return "a peer left"

raise PeerLeft()
"""


def test_a_sigterm_inside_torchs_excepthook_still_says_what_the_close_lost():
    """A rank's unhandled error (a peer left), then torchrun's SIGTERM while torch.distributed's own
    excepthook formats the traceback into an in-memory buffer: what our SIGTERM close says (here a
    backend's lost steps) reaches the process's stderr, and the process still ends by the signal.
    (test_teardown's thread case lost the line once in about five runs this way.)"""
    done = subprocess.run(
        [sys.executable, "-c", LATE_SIGTERM], capture_output=True, text=True, timeout=120, env=torchrun.torchrun_env()
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert "nemo_memlog: mlflow did not store 3 of the 3 logged steps: steps 1-3" in done.stderr, done.stderr[-3000:]


LOCKED_SIGTERM = """
import logging, os, signal, sys
from nemo_memlog import LoggerConfig, build_writers

root = sys.argv[1]
writers = build_writers(LoggerConfig(
    writer_mode="thread", writer_close_timeout_s=15, tensorboard_dir=f"{root}/tensorboard",
    wandb_project="p", wandb_exp_name="run", wandb_save_dir=root,
    comet_project="p", comet_offline_directory=f"{root}/comet",
))
def step(at):
    return {"memory/peak_host_rss_gb": 1.0 + at, "memory/pp_stage_0/peak_host_rss_gb": 1.0 + at,
            "memory/pp_stage_1/peak_host_rss_gb": 0.5 + at}
for at in range(1, 21):
    writers.log(step(at), at)
assert writers.flush(120), writers.stats()  # every backend open, every step written

class Interrupted(logging.Logger):
    def __init__(self, name):
        super().__init__(name)
        os.kill(os.getpid(), signal.SIGTERM)  # lands while getLogger holds logging's module lock

logging.setLoggerClass(Interrupted)
logging.getLogger("a.module.imported.late")  # as an import does, on the main thread
writers.log(step(21), 21)  # the next step: held there until the process ends
print("the main thread ran past its SIGTERM", file=sys.stderr)
"""


def test_a_sigterm_while_the_main_thread_holds_loggings_lock_still_completes_every_store(tmp_path):
    """Thread mode: a launcher's SIGTERM lands while the main thread holds logging's module lock (any
    ``getLogger``, a first ``isEnabledFor``: comet_ml's exit hook does one). A close run in the signal
    handler waited there for backend threads that need that lock, so W&B's run and Comet's archive
    (a 22-byte empty zip) were lost at the close's deadline, as test_teardown's thread case saw on a
    loaded machine. The close runs in a thread of its own: every step written before the signal is
    in TensorBoard, the finished W&B run and the Comet archive, the step offered after it is held and
    stored nowhere, and the process ends by the signal."""
    done = subprocess.run(
        [sys.executable, "-c", LOCKED_SIGTERM, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert "ran past its SIGTERM" not in done.stderr and "did not finish closing" not in done.stderr, done.stderr
    assert wandb_finished(tmp_path), done.stderr[-3000:]
    for backend, steps in stored_steps(tmp_path, skip={"mlflow"}).items():
        assert steps == set(range(1, 21)), (backend, sorted(steps), done.stderr[-3000:])
