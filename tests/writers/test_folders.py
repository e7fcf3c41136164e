"""A log folder that cannot be written, and a disk that fills up, for real: a read-only bind mount
and a 64 KiB tmpfs (root, as on this project's machines; skipped elsewhere). Training never sees
an error; the backend says once, in plain words, which folder and setting; a permanent failure is
not retried; the close is not held up for its budget; and the end says how many steps each backend
did not store."""

import pytest

from nemo_memlog import LoggerConfig
from nemo_memlog.testing.mounts import mounted, read_only
from nemo_memlog.testing.notices import said
from nemo_memlog.testing.wait import returns_within
from nemo_memlog.writers import build_writers

pytestmark = pytest.mark.processes

BUDGET_S = 25.0  # the default writer_close_timeout_s
#: The close's budget here: a close held up for it by a backend that cannot write would still run at
#: CLOSED_BY_S (the product promises FAILING_CLOSE_S, fanout.py), however loaded the machine is.
HELD_BUDGET_S, CLOSED_BY_S = 600.0, 120.0


def log_and_close(cfg, steps: int, width: int = 8):
    with said(warned=False) as caught:
        fanout = build_writers(cfg)
        for step in range(1, steps):
            fanout.log({f"memory/metric_{i}": float(step * i) for i in range(width)}, step)  # never raises
        fanout.flush(timeout_s=BUDGET_S)  # the writers are up (on a loaded machine a process takes a while)
        fanout.log({f"memory/metric_{i}": float(steps * i) for i in range(width)}, steps)
        # The last logging call: the exit path closes at once, no flush first.
        returns_within(lambda: fanout.close(timeout_s=HELD_BUDGET_S), CLOSED_BY_S, "the close")
        stats = fanout.stats()
    return stats, [w for w in caught]


@pytest.mark.parametrize("writer_mode", ["process", "thread"])
def test_a_read_only_folder_is_named_once_not_retried_and_does_not_hold_up_the_exit(tmp_path, writer_mode):
    with read_only(tmp_path / "logs") as folder:
        cfg = LoggerConfig(tensorboard_dir=str(folder / "tb"), writer_mode=writer_mode)
        stats, messages = log_and_close(cfg, steps=5)
    said = [m for m in messages if "tensorboard" in m and "this backend stops" in m]
    assert len(said) == 1 and f"tensorboard_dir='{folder / 'tb'}'" in said[0], messages
    assert "Read-only file system" in said[0] and "point tensorboard_dir at a writable folder" in said[0]
    assert "this backend stops" in said[0]
    assert stats["tensorboard"]["failures"] == 1, "a permanent failure is tried once, not retried"
    assert stats["tensorboard"]["dropped"] == 5 and stats["tensorboard"]["pending"] == 0
    assert any(
        "tensorboard did not store 5 of the 5 logged steps" in m and m.endswith(": steps 1-5") for m in messages
    ), messages


def test_a_full_disk_is_said_once_and_the_end_counts_what_was_not_stored(tmp_path, capfd):
    with mounted(tmp_path / "tiny", "-t", "tmpfs", "-o", "size=64k", "tmpfs") as folder:
        cfg = LoggerConfig(tensorboard_dir=str(folder / "tb"), tensorboard_queue_size=1)
        stats, messages = log_and_close(cfg, steps=300, width=40)
    full = [m for m in messages if "tensorboard" in m and "disk holding its folder is full" in m]
    assert len(full) == 1, messages
    lost = stats["tensorboard"]["pending"] + stats["tensorboard"]["dropped"]
    assert stats["tensorboard"]["written"] < 300 and lost > 0, stats
    summary = [m for m in messages if "tensorboard did not store" in m]
    assert len(summary) == 1 and "(its disk is full)" in summary[0], messages
    printed = capfd.readouterr().err  # the writer process's stderr is this process's
    assert "Traceback" not in printed, printed  # not TensorBoard's thread's raw 30 lines
