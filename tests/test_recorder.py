"""The flight recorder (recorder.py, oom.py): what it writes, read back with records.py.

Exit paths (close, sys.exit, an unhandled exception, SIGTERM, SIGKILL) run in real
subprocesses, all at once; the multi-rank runs under torchrun are tests/test_postmortem_e2e.py.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from nemo_memlog import FlightRecorder, LoggerConfig
from nemo_memlog.config import memory_record_dir
from nemo_memlog.failure import oom, records
from nemo_memlog.failure.evidence import HostEvidence, cgroup_events_path
from nemo_memlog.failure.identity import run_id
from nemo_memlog.failure.recorder import open_recorder
from nemo_memlog.rank.memory import capacity_report, report_memory
from nemo_memlog.testing.notices import said
from tests.readback import read_back

ROOT = Path(__file__).resolve().parents[1]


def full_report():
    report = report_memory()
    report.update(capacity_report())
    return report


def test_records_header_and_ring_read_back(tmp_path):
    before = set(threading.enumerate())
    recorder = FlightRecorder(tmp_path, liveness_period_s=0.05)
    (beating,) = [t for t in threading.enumerate() if t not in before and t.name == "nemo_memlog-liveness"]
    report = full_report()
    for iteration in range(1, 41):
        recorder.record(iteration * 10, report)
    deadline = time.monotonic() + 30  # the liveness thread beats every 0.05 s: wait for three beats
    while ((read_back(recorder.path)[1] or {}).get("beats") or 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    header, liveness, steps = read_back(recorder.path)
    assert Path(recorder.path).name == "rank-00000.memrec"
    assert Path(recorder.path).stat().st_size == records.file_bytes(records.DEFAULT_SLOTS, records.DEFAULT_SLOT_BYTES)
    assert header["pid"] == os.getpid() and header["rank"] == 0 and header["world_size"] == 1
    assert header["liveness_period_s"] == 0.05 and header["host"] == os.uname().nodename
    # The ring keeps the last DEFAULT_SLOTS records, in order, with the report as given.
    assert [r["iteration"] for r in steps] == [i * 10 for i in range(41 - records.DEFAULT_SLOTS, 41)]
    assert [r["seq"] for r in steps] == list(range(40 - records.DEFAULT_SLOTS, 40))
    assert all(r["kind"] == "step" for r in steps)
    assert steps[-1]["report"].keys() == report.keys()
    assert steps[-1]["report"]["host_rss_gb"] == report["host_rss_gb"]
    assert abs(steps[-1]["time"] - time.time()) < 5
    # The liveness thread beat several times, with the host's evidence.
    assert liveness["beats"] >= 3 and time.time() - liveness["alive"] < 2
    assert 0 < liveness["host_available_gb"] and 0 < liveness["host_rss_gb"] < liveness["host_available_gb"] * 10
    recorder.close()
    _, after, ended = read_back(recorder.path)
    assert ended[-1]["kind"] == "end" and ended[-1]["reason"] == "close" and ended[-1]["iteration"] == 400
    # The thread stopped at close: it ends (a generous bound for a loaded machine; close itself
    # waits for it), and nothing beat between close's return and its end.
    beating.join(timeout=30)
    assert not beating.is_alive()
    assert read_back(recorder.path)[1]["beats"] == after["beats"]


def test_what_tests_pass_instead_of_patching(tmp_path):
    """The header's identity, a clock and no liveness thread as constructor parameters;
    abandon() leaves the file as a SIGKILL would."""
    who = {"run_id": "sim", "rank": 5, "world_size": 8, "pp_rank": 1, "tp_rank": 0, "dp_rank": 1, "host": "node-7"}
    recorder = FlightRecorder(tmp_path, identity=who, clock=lambda: 1000.0, liveness=False, liveness_period_s=0.01)
    recorder.record(3, {"x": 1.0})
    recorder.abandon()
    assert not recorder.is_open and recorder.fileno() is None
    header, liveness, found = read_back(recorder.path)
    assert Path(recorder.path).name == "rank-00005.memrec" and recorder.snapshot_name(0) == "rank-00005.oom-0.pickle"
    assert {key: header[key] for key in who} == who and header["started"] == 1000.0
    assert liveness is None  # no thread: no beat
    assert [(r["kind"], r["time"]) for r in found] == [("step", 1000.0)]  # and no end marker
    recorder.close()  # after abandon() nothing more is written
    assert len(read_back(recorder.path)[2]) == 1


def test_host_evidence_matches_proc(tmp_path):
    evidence = HostEvidence().read()
    vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    assert evidence["vmstat_oom_kill"] == int(vmstat["oom_kill"])
    cgroup = cgroup_events_path()
    if cgroup is None:
        assert evidence["cgroup_oom_kill"] is None
    else:
        fields = dict(line.split() for line in Path(cgroup).read_text().splitlines())
        assert evidence["cgroup_oom_kill"] == int(fields["oom_kill"])
    # cgroup v2's "0::/path" line leads to <root>/<path>/memory.events.
    fake = tmp_path / "cgroup"
    (tmp_path / "fs" / "job" / "step").mkdir(parents=True)
    (tmp_path / "fs" / "job" / "step" / "memory.events").write_text("low 0\noom 2\noom_kill 1\noom_group_kill 0\n")
    fake.write_text("0::/job/step\n")
    assert cgroup_events_path(str(fake), str(tmp_path / "fs")) == str(tmp_path / "fs/job/step/memory.events")


def test_a_report_too_large_for_its_slot_keeps_the_essentials(tmp_path):
    recorder = FlightRecorder(tmp_path, slot_bytes=1024)
    report = {**full_report(), **{f"extra_metric_number_{i}": float(i) for i in range(100)}}
    recorder.record(7, report)
    recorder.record(8, {"peak_reserved_gb": 1.5})
    recorder.close()
    _, _, (big, small, end) = read_back(recorder.path)
    assert big["truncated"] is True and big["iteration"] == 7
    assert big["report"]["host_rss_gb"] == report["host_rss_gb"] and "extra_metric_number_0" not in big["report"]
    assert "truncated" not in small and small["report"] == {"peak_reserved_gb": 1.5}
    assert end["reason"] == "close"


def test_an_unwritable_folder_warns_once_and_training_goes_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with said(warned=False) as caught:
        recorder = FlightRecorder(blocker / "records")
        recorder.record(1, {"x": 1.0})
        recorder.close()
    assert [w for w in caught if "flight records" in w][0].count("memory_record_dir") == 1
    assert not (blocker.parent / "records").exists()


def test_an_io_error_later_warns_once_and_stops_recording(tmp_path):
    recorder = FlightRecorder(tmp_path / "r", liveness_period_s=60)
    recorder.record(1, {"x": 1.0})
    read_only = os.open(recorder.path, os.O_RDONLY)
    os.dup2(read_only, recorder.fileno())  # the descriptor now refuses writes (EBADF), as a failing disk would
    os.close(read_only)
    with said(warned=False) as caught:
        for iteration in range(2, 5):
            recorder.record(iteration, {"x": 1.0})
        recorder.close()
    assert len([w for w in caught if "recording stops" in w]) <= 1
    assert not recorder.is_open
    assert [r["iteration"] for r in read_back(recorder.path)[2]] == [1]


def test_reopening_a_folder_starts_a_fresh_file_and_one_process_shares_its_recorder(tmp_path):
    first = open_recorder(tmp_path)
    assert open_recorder(tmp_path) is first  # two monitors of one process, one file
    first.record(1, {"x": 1.0})
    first.close()
    assert first.is_open  # the other user still has it
    first.close()
    assert not first.is_open
    second = open_recorder(tmp_path)
    assert second is not first
    second.record(5, {"x": 2.0})
    assert [r["iteration"] for r in read_back(second.path)[2]] == [5]  # the earlier records are gone
    second.close()


def test_oom_observer_called_as_torch_calls_it(tmp_path):
    """Without a GPU the one stand-in: call the recorder's observer (the one it registers with
    process_wide) with torch's arguments (tests/gpu/test_oom_gpu.py provokes a real CUDA OOM)."""
    recorder = FlightRecorder(tmp_path, liveness_period_s=60)
    recorder.record(41, full_report())
    recorder.on_cuda_oom(0, 2_000_000_000, 80_000_000_000, 1_000_000_000)
    recorder.close()
    _, _, (step, hit, end) = read_back(recorder.path)
    assert hit["kind"] == "oom" and hit["iteration"] == 41
    assert (hit["device"], hit["bytes_requested"], hit["device_limit"], hit["device_free"]) == (
        0,
        2_000_000_000,
        80_000_000_000,
        1_000_000_000,
    )
    assert hit["report"].keys() == step["report"].keys()
    assert "snapshot" not in hit  # no CUDA: no allocator snapshot to take
    assert recorder.oom_count == 1 and end["reason"] == "close"


def test_free_blocks_from_a_snapshot_layout():
    mb = 1 << 20
    snapshot = {
        "segments": [
            {
                "total_size": 20 * mb,
                "allocated_size": 12 * mb,
                "blocks": [{"size": 12 * mb, "state": "active_allocated"}, {"size": 8 * mb, "state": "inactive"}],
            },
            {
                "total_size": 6 * mb,
                "allocated_size": 2 * mb,
                "blocks": [
                    {"size": 3 * mb, "state": "inactive"},
                    {"size": 2 * mb, "state": "active_allocated"},
                    {"size": 1 * mb, "state": "inactive"},
                ],
            },
        ]
    }
    assert oom.free_blocks(snapshot) == {"largest_free_block": 8 * mb, "reserved_free": 12 * mb}
    assert oom.free_blocks({"segments": []}) == {"largest_free_block": 0, "reserved_free": 0}


def test_run_id_without_a_process_group_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert run_id() == "4242.3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert run_id() == "elastic-7"


def test_default_folder_and_off(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    on = dict(log_memory_to_tensorboard=True)
    assert memory_record_dir(LoggerConfig(**on, tensorboard_dir="runs/a/tb")) == str(tmp_path / "runs/a/memory_records")
    assert memory_record_dir(LoggerConfig(**on, wandb_save_dir="w")) == str(tmp_path / "w/memory_records")
    assert memory_record_dir(LoggerConfig(**on)) == str(tmp_path / "memory_records")
    mine = LoggerConfig(**on, tensorboard_dir="tb", memory_record_dir="mine")
    assert memory_record_dir(mine) == str(tmp_path / "mine")
    assert memory_record_dir(LoggerConfig(**on, memory_record_dir="off")) is None
    assert memory_record_dir(LoggerConfig(tensorboard_dir="tb")) is None  # memory logging off
    for bad in ("", 3):
        with pytest.raises(ValueError, match="memory_record_dir must be a folder path, 'off'"):
            LoggerConfig(memory_record_dir=bad)
    with pytest.raises(ValueError, match="memory_record_history must be true or false"):
        LoggerConfig(memory_record_history="yes")


def test_training_log_records_every_logging_step_beside_the_tensorboard_folder(tmp_path, capfd):
    from nemo_memlog import close_writers, training_log

    cfg = LoggerConfig(
        log_memory_to_tensorboard=True, tensorboard_log_interval=2, tensorboard_dir=str(tmp_path / "run" / "tb")
    )
    logged = Collected()  # the writers are not what this test is about: no TensorBoard opened
    for iteration in range(1, 8):
        training_log(iteration, cfg, writers=logged)
    close_writers()
    assert sorted(logged.steps) == [2, 4, 6]
    path = tmp_path / "run" / "memory_records" / "rank-00000.memrec"
    _, _, found = read_back(path)
    assert [(r["kind"], r["iteration"]) for r in found] == [("step", 2), ("step", 4), ("step", 6), ("end", 6)]
    assert found[-1]["reason"] == "close" and "host_available_gb" in found[0]["report"]
    assert capfd.readouterr().err.count(f"memory flight records in {path.parent}") == 1
    off = LoggerConfig(
        log_memory_to_tensorboard=True, tensorboard_dir=str(tmp_path / "off" / "tb"), memory_record_dir="off"
    )
    training_log(1, off, writers=logged)
    close_writers()
    assert not (tmp_path / "off" / "memory_records").exists()


class Collected:
    def __init__(self):
        self.steps = []

    def log(self, metrics, step):
        self.steps.append(step)

    def flush(self):
        pass


EXIT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch.distributed  # imported once, before the forks: each way to end is a child
    from nemo_memlog import FlightRecorder
    from nemo_memlog.failure import records
    from nemo_memlog.testing.wait import wait_for
    def beats():  # the liveness thread's count in this rank's file, as the parent will read it
        with open(recorder.path, "rb") as record:
            record.seek(records.HEADER_BYTES)
            slot = record.read(records.LIVENESS_BYTES)
        try:
            return (records.decode(slot) or {}).get("beats") or 0
        except records.RecordError:  # caught mid-write: the next poll reads it whole
            return 0
    children = {}
    for how in sys.argv[2:]:
        pid = os.fork()
        if pid == 0:
            break
        children[how] = pid
    else:
        for how, pid in children.items():
            print(how, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
        sys.exit(0)
    recorder = FlightRecorder(os.path.join(sys.argv[1], how), liveness_period_s=0.05)
    recorder.record(3, {"x": 1.0})
    if how == "close":
        recorder.close()
    elif how == "exit":
        sys.exit(3)
    elif how == "exception":
        raise RuntimeError("loss is NaN")
    elif how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    elif how == "sigkill":
        wait_for(lambda: beats() >= 2, 60, "two liveness beats")
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "abandon":  # as a SIGKILL leaves it: the exit that follows writes no marker either
        wait_for(lambda: beats() >= 2, 60, "two liveness beats")
        recorder.abandon()
""")


@pytest.mark.processes
def test_every_exit_path_leaves_its_end_marker(tmp_path):
    expected = {
        "close": (0, "close"),
        "exit": (3, "exit"),
        "exception": (1, "exception"),
        "sigterm": (-signal.SIGTERM, "sigterm"),
        "sigkill": (-signal.SIGKILL, None),
        "abandon": (0, None),
    }
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), *expected],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    exit_codes = dict(line.split() for line in done.stdout.splitlines())
    for how, (returncode, reason) in expected.items():
        assert int(exit_codes[how]) == returncode, f"{how}: {done.stderr}"
        _, liveness, found = read_back(tmp_path / how / "rank-00000.memrec")
        assert found[0]["kind"] == "step" and found[0]["iteration"] == 3
        if reason is None:  # SIGKILL (or abandon()): the step survives in the page cache, no end marker
            assert len(found) == 1 and liveness["beats"] >= 2
        else:
            assert [r["kind"] for r in found] == ["step", "end"] and found[1]["reason"] == reason, how
    _, _, (_, raised) = read_back(tmp_path / "exception" / "rank-00000.memrec")
    assert raised["detail"] == "RuntimeError: loss is NaN"
    assert "RuntimeError: loss is NaN" in done.stderr  # the hook before ours still printed it
