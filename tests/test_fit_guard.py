"""Nothing of a probe outlives ``nemo-memlog fit`` (launch/guard.py), whatever happens to fit: a
SIGKILL, two Ctrl-C or two SIGTERMs during the grace; with the probe's processes of every kind the
parent-death signal alone missed: a wrapper script, a setsid daemon, a daemon that double-forked,
a child that ignores SIGTERM, and torchrun's ranks under ``bash -c``. Real processes; what is left
is found by the test's own folder in the command lines (/proc), apart from the guard's own walk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_memlog.testing.probe_stub import STUB
from nemo_memlog.testing.torchrun import ROOT
from nemo_memlog.testing.wait import as_at_a_terminal, left_behind, seconds_until, wait_for

FIT = [sys.executable, "-m", "nemo_memlog.cli", "fit"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
#: The probe: a wrapper script that starts, each with the script's folder (the test's) in its
#: command line, a setsid daemon, one orphaned at once (double fork), a child that ignores SIGTERM,
#: and through another bash the python that writes the record (STUB) or, above size 2 (MODE's
#: default), hangs.
PROBE = """\
here=$(dirname "$0")
setsid bash -c 'exec -a "$0" sleep 300' "$here/daemon" &
setsid bash -c '(exec -a "$0" sleep 300 &)' "$here/double-forked" &
bash -c 'trap "" TERM; exec -a "$0" sleep 300' "$here/ignores-sigterm" &
touch "$NEMO_MEMLOG_PROBE_DIR/started"
bash -c '"$@"; true' "$here/wrapper" "$PYTHON" -c "$STUB" "$1" "${MODE:-hang-above-2}" "$here"
wait
"""
#: A torchrun job of two ranks that only sleep: each says it started, in the test's folder.
RANK = """import os, sys, time
open(os.path.join(sys.argv[1], "rank-" + os.environ["RANK"]), "w").close()
time.sleep(300)
"""


KINDS = ("daemon", "double-forked", "ignores-sigterm", "wrapper")
#: Deadlines for what the guard does, well inside the stub processes' 300 s sleep (so a guard that
#: does not do it still fails) and wide enough for a loaded 2-core machine.
NOTHING_LEFT_S = 90
WAITED_S = 60


def start_fit(tmp_path: Path, grace_s: float, mode: str = "hang-above-2") -> subprocess.Popen:
    """fit on the stub probe (its temporary folder under ``tmp_path``/tmp), not waited for."""
    script = tmp_path / "probe.sh"
    script.write_text(PROBE)
    (tmp_path / "tmp").mkdir()
    env = {**ENV, "TMPDIR": str(tmp_path / "tmp"), "PYTHON": sys.executable, "STUB": STUB, "MODE": mode}
    command = [*FIT, "--capacity-gb", "8", "--grace-s", str(grace_s), "--", "bash", str(script)]
    return subprocess.Popen([*command, "{micro_batch_size:2}"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_at_a_terminal)  # fmt: skip


def probe_running(tmp_path: Path, fit: subprocess.Popen, folder: str) -> None:
    """Wait until the probe in ``folder`` (probe-N-mbs-S) has started every kind of process."""

    def running() -> bool:
        every = " ".join(left_behind(str(tmp_path)))
        return all(f"{tmp_path}/{kind} " in every for kind in KINDS) and " hang-above-" in every

    wait_for(
        lambda: list((tmp_path / "tmp").glob(f"nemo-memlog-fit-*/{folder}/started")) and running(),
        60,
        f"the processes of {folder}",
        proc=fit,
        detail=lambda: fit.stderr.read() if fit.poll() is not None else "",
    )


def seconds_until_nothing_left(marker: str) -> float:
    """Seconds until nothing of the probe runs. The stub's processes sleep 300 s: a guard that did not
    end the tree, or ended it with SIGTERM alone (no SIGKILL after the grace: ``ignores-sigterm``
    stays), leaves them past this deadline however loaded the machine is; its speed is printed only."""
    return seconds_until(lambda: not left_behind(marker), NOTHING_LEFT_S, "the probe's every process ended",
                         detail=lambda: "\n".join(left_behind(marker)), interval_s=0.05)  # fmt: skip


@pytest.mark.processes
def test_a_sigkilled_fit_leaves_no_process_and_no_scratch_folder(tmp_path):
    marker, grace_s = str(tmp_path), 2.0
    fit = start_fit(tmp_path, grace_s=grace_s)
    try:
        probe_running(tmp_path, fit, "probe-2-mbs-16")  # probe 1 measured size 2, and was ended
        fit.kill()
        fit.wait(timeout=WAITED_S)
        seconds = seconds_until_nothing_left(marker)
    finally:
        if fit.poll() is None:
            fit.kill()
        fit.communicate(timeout=WAITED_S)  # its pipes end with the guard, which shares them
    wait_for(lambda: not list((tmp_path / "tmp").iterdir()), WAITED_S, "the scratch folder removed")
    print(f"fit SIGKILLed: nothing of the probe left {seconds:.1f} s later (grace {grace_s:g} s)")


@pytest.mark.processes
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_interrupt_shortens_the_grace_and_never_abandons_the_tree(tmp_path, signum, code):
    marker = str(tmp_path)
    fit = start_fit(tmp_path, grace_s=2 * WAITED_S, mode="hang-above-0")  # no record: fit waits on probe 1
    try:
        probe_running(tmp_path, fit, "probe-1-mbs-2")
        fit.send_signal(signum)
        # WAITED_S is half the grace: the SIGTERM-ignoring child is still in it below.
        wait_for(lambda: not any("daemon" in line for line in left_behind(marker)), WAITED_S, "the SIGTERM sent")
        assert any("ignores-sigterm" in line for line in left_behind(marker))  # in its grace
        began = time.monotonic()
        fit.send_signal(signum)
        # Without the second signal's SIGKILL, fit would wait out the 120 s grace: past this deadline.
        _, stderr = fit.communicate(timeout=WAITED_S)
        seconds = time.monotonic() - began
    finally:
        if fit.poll() is None:
            fit.kill()
            fit.communicate(timeout=WAITED_S)
    assert fit.returncode == code, stderr
    assert "interrupted by" in stderr and "every probe's processes ended" in stderr
    assert not left_behind(marker)  # at fit's exit already: it waited for the guard
    assert not list((tmp_path / "tmp").iterdir())
    print(f"second {signal.Signals(signum).name}: fit exited {code} {seconds:.1f} s later, nothing left")


@pytest.mark.processes
def test_a_sigkilled_fit_ends_torchrun_and_its_ranks_under_a_wrapper(tmp_path):
    marker = str(tmp_path)
    (tmp_path / "rank.py").write_text(RANK)
    torchrun = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 {tmp_path / 'rank.py'}"
    fit = subprocess.Popen([*FIT, "--capacity-gb", "8", "--work-dir", str(tmp_path / "work"), "--", "bash", "-c",
                            f"{torchrun} {tmp_path}; true", "{micro_batch_size}"],
                           env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: (tmp_path / "rank-0").exists() and (tmp_path / "rank-1").exists(), 120,
                 "both ranks started", proc=fit)  # fmt: skip
        assert len(left_behind(marker)) >= 4  # bash, torchrun, two ranks (and the guard)
        fit.kill()
        fit.wait(timeout=WAITED_S)
        seconds = seconds_until_nothing_left(marker)
    finally:
        if fit.poll() is None:
            fit.kill()
        fit.communicate(timeout=WAITED_S)
    print(f"fit SIGKILLed under torchrun: nothing left {seconds:.1f} s later")


@pytest.mark.processes
def test_a_command_that_cannot_be_run_is_a_probe_that_died_with_127(tmp_path):
    done = subprocess.run([*FIT, "--", str(tmp_path / "no-such-launcher"), "{micro_batch_size}"], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "exited with 127" in done.stderr and "cannot run" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
