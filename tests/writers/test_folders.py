"""A log folder that cannot be written, and a disk that fills up, for real: a read-only bind mount
and a 64 KiB tmpfs (root, as on this project's machines; skipped elsewhere). Training never sees
an error; the backend says once, in plain words, which folder and setting; a permanent failure is
not retried; the close is not held up for its budget; and the end says how many steps each backend
did not store."""

import contextlib
import subprocess
import time

import pytest

from nemo_memlog import LoggerConfig
from nemo_memlog.writers import build_writers
from tests.notices import said

pytestmark = pytest.mark.processes

BUDGET_S = 25.0  # the default writer_close_timeout_s: what a close held up by a backend would take
EXIT_BOUND_S = 10.0  # a backend that cannot write holds the exit at most this long after the last logging call


@contextlib.contextmanager
def mounted(target, *options):
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@contextlib.contextmanager
def read_only(folder):
    """``folder`` bind-mounted read-only onto itself."""
    with mounted(folder, "--bind", str(folder)):
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
        yield folder


def log_and_close(cfg, steps: int, width: int = 8):
    with said(warned=False) as caught:
        fanout = build_writers(cfg)
        for step in range(1, steps):
            fanout.log({f"memory/metric_{i}": float(step * i) for i in range(width)}, step)  # never raises
        fanout.flush(timeout_s=BUDGET_S)  # the writers are up (on a loaded machine a process takes a while)
        fanout.log({f"memory/metric_{i}": float(steps * i) for i in range(width)}, steps)
        started = time.monotonic()  # the last logging call: the exit path closes at once, no flush first
        fanout.close()
        closing_s = time.monotonic() - started
        stats = fanout.stats()
    return stats, closing_s, [w for w in caught]


@pytest.mark.parametrize("writer_mode", ["process", "thread"])
def test_a_read_only_folder_is_named_once_not_retried_and_does_not_hold_up_the_exit(tmp_path, writer_mode):
    with read_only(tmp_path / "logs") as folder:
        cfg = LoggerConfig(tensorboard_dir=str(folder / "tb"), writer_mode=writer_mode)
        stats, closing_s, messages = log_and_close(cfg, steps=5)
    said = [m for m in messages if "tensorboard" in m and "this backend stops" in m]
    assert len(said) == 1 and f"tensorboard_dir='{folder / 'tb'}'" in said[0], messages
    assert "Read-only file system" in said[0] and "point tensorboard_dir at a writable folder" in said[0]
    assert "this backend stops" in said[0]
    assert stats["tensorboard"]["failures"] == 1, "a permanent failure is tried once, not retried"
    assert stats["tensorboard"]["dropped"] == 5 and stats["tensorboard"]["pending"] == 0
    assert any(
        "tensorboard did not store 5 of the 5 logged steps" in m and m.endswith(": steps 1-5") for m in messages
    ), messages
    assert closing_s < EXIT_BOUND_S, f"the close waited {closing_s:.1f} s on a backend that cannot write"


def test_a_full_disk_is_said_once_and_the_end_counts_what_was_not_stored(tmp_path, capfd):
    with mounted(tmp_path / "tiny", "-t", "tmpfs", "-o", "size=64k", "tmpfs") as folder:
        cfg = LoggerConfig(tensorboard_dir=str(folder / "tb"), tensorboard_queue_size=1)
        stats, closing_s, messages = log_and_close(cfg, steps=300, width=40)
    full = [m for m in messages if "tensorboard" in m and "disk holding its folder is full" in m]
    assert len(full) == 1, messages
    lost = stats["tensorboard"]["pending"] + stats["tensorboard"]["dropped"]
    assert stats["tensorboard"]["written"] < 300 and lost > 0, stats
    summary = [m for m in messages if "tensorboard did not store" in m]
    assert len(summary) == 1 and "(its disk is full)" in summary[0], messages
    assert closing_s < EXIT_BOUND_S, f"the close waited {closing_s:.1f} s on a full disk"
    printed = capfd.readouterr().err  # the writer process's stderr is this process's
    assert "Traceback" not in printed, printed  # not TensorBoard's thread's raw 30 lines
