"""`nemo-memlog postmortem` on flight records written by the recorder's own code (tests/flight_sim.py).

Each scenario writes real files with FlightRecorder and runs the command (in-process through
cli.main, and once as a subprocess to show it imports no torch). The end-to-end runs under
torchrun (SIGKILL, SIGTERM, clean exit) are tests/test_postmortem_e2e.py.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_memlog.cli import main
from nemo_memlog.failure import records
from nemo_memlog.testing.flight_sim import T0, closed_after, layout, write_rank, write_run

ROOT = Path(__file__).resolve().parents[1]
FRAGMENTED_OOM = {
    "device": 0,
    "bytes_requested": int(2.1e9),
    "device_limit": int(80e9),
    "device_free": int(1.3e9),
    "largest_free_block": int(0.4e9),
    "reserved_free": int(2.6e9),
    "snapshot": "rank-00012.oom-0.pickle",
}


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["postmortem", *map(str, argv)])
    print(out.getvalue(), err.getvalue())  # shown with pytest -s
    return code, out.getvalue(), err.getvalue()


def run_json(*argv) -> tuple[int, dict]:
    code, out, _ = run_cli(*argv, "--json")
    return code, json.loads(out)


def by_rank(result: dict) -> dict[int, dict]:
    return {entry["rank"]: entry for entry in result["ranks"]}


def test_cuda_oom_is_the_first_failure_with_the_fragmentation_sentence(tmp_path):
    ranks = closed_after(layout(pp=4, tp=2, dp=2, gpus_per_node=4), 30.0)  # 16 ranks, 4 hosts
    oom = ranks[12]  # pp 3, tp 0, dp 0 on node-003
    oom.stopped, oom.oom, oom.end = T0, FRAGMENTED_OOM, "exception"
    for late in ranks[13:15]:  # killed later, without an end
        late.stopped, late.end = T0 + 20.0, None
    second_oom = ranks[3]
    second_oom.stopped, second_oom.oom, second_oom.end = T0 + 10.0, dict(FRAGMENTED_OOM, snapshot=None), None
    write_run(tmp_path / "records", ranks)

    code, result = run_json(tmp_path / "records")
    assert code == 1
    first = result["first_failure"]
    assert (first["rank"], first["status"], first["pp_rank"], first["host"]) == (12, "cuda_oom", 3, "node-003")
    assert first["fragmentation"] is True and first["ambiguous_with"] == []
    expected = (
        "rank 12 (pp stage 3, tp 0, dp 0) on node-003 hit a CUDA OOM after iteration 30 (the last recorded) "
        "asking for 2.1 GB with 1.3 GB free; 3.9 GB was free in total, but the largest free block was "
        "400 MB, which is fragmentation: try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    assert first["sentence"] == expected == result["sentence"]
    ranks_json = by_rank(result)
    assert ranks_json[12]["end_reason"] == "exception" and ranks_json[12]["oom"]["bytes_requested"] == int(2.1e9)
    assert ranks_json[3]["status"] == "cuda_oom"
    assert [ranks_json[r]["status"] for r in (13, 14)] == ["unfinished", "unfinished"]
    assert ranks_json[0]["status"] == "closed" and ranks_json[0]["end_reason"] == "sigterm"
    assert result["failed_ranks"][:2] == [12, 3]

    code, text, _ = run_cli(tmp_path / "records", "--no-png")
    assert code == 1
    assert "FIRST FAILURE: " + expected in text
    assert f"allocator snapshot: {tmp_path / 'records' / 'rank-00012.oom-0.pickle'}" in text
    assert "status: 12 closed, 2 cuda_oom, 2 unfinished; failed ranks in order: 12, 3, 13, 14" in text


def test_not_fragmented_oom_says_the_working_set_does_not_fit(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=1), 30.0)
    ranks[1].stopped, ranks[1].end = T0, "exception"
    ranks[1].oom = dict(FRAGMENTED_OOM, reserved_free=int(0.5e9), largest_free_block=int(0.3e9))
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert code == 1 and result["first_failure"]["fragmentation"] is False
    assert (
        "1.8 GB was free in total with the allocator's cache: the working set does not fit in 80 GB"
        in result["sentence"]
    )
    assert "expandable_segments" not in result["sentence"]


def test_a_killed_rank_among_ranks_killed_later_is_the_first_failure(tmp_path):
    """Lock-step PP: every rank stops in the same iteration and none records an end; the one
    whose liveness stopped first is named, with its host's OOM-kill counter evidence."""
    ranks = layout(pp=4, tp=1, dp=2, gpus_per_node=2)  # 8 ranks on node-000..003
    for rank in ranks:
        rank.end, rank.vmstat_oom_kill, rank.cgroup_oom_kill = None, 2, 0
    for offset, rank in zip([9.0, 8.0, 7.5, 12.0, 6.4, 9.9, 11.0, 8.8], ranks):
        rank.stopped = T0 + offset
    victim = ranks[5]  # pp 2, dp 1 on node-002
    victim.stopped, victim.host_rss_gb, victim.host_available_gb = T0, 61.0, 0.4
    ranks[4].vmstat_oom_kill, ranks[4].cgroup_oom_kill = 3, 1  # its host-mate, alive later, saw the kill
    write_run(tmp_path / "memory_records", ranks)

    code, result = run_json(tmp_path / "memory_records", "--clock-skew-s", "2")
    assert code == 1
    first = result["first_failure"]
    assert (first["rank"], first["status"], first["last_iteration"]) == (5, "unfinished", 30)
    assert first["ambiguous_with"] == []  # the next one stopped 6.4 s later
    assert first["probable_host_oom_kill"] is True
    evidence = " ".join(first["host_oom_kill_evidence"])
    assert "vmstat oom_kill counter went up after its last beat (2 -> 3)" in evidence
    assert "cgroup oom_kill counter went up after its last beat (0 -> 1)" in evidence
    assert "MemAvailable was 400 MB of 512 GB" in evidence
    assert result["sentence"].startswith("rank 5 (pp stage 2, tp 0, dp 1) on node-002 vanished at ")
    assert "(last alive), after iteration 30 (last recorded) with host RSS 61 GB of 512 GB while " in result["sentence"]
    assert "probably the kernel's OOM killer (check `dmesg` on node-002)" in result["sentence"]
    assert all(entry["status"] == "unfinished" for entry in result["ranks"])
    assert result["failed_ranks"] == [5, 4, 2, 1, 7, 0, 6, 3]
    assert not by_rank(result)[4]["probable_host_oom_kill"]  # nobody on node-002 beat after it


GLOO_PEER_CLOSED = (
    "MemoryReduceError: memory reduction over the group of global ranks [0, 1, 2, 3] at iteration 31: a peer left "
    "after 0.4 s, before memory_reduce_timeout_s=300s ([../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Connection closed by peer [127.0.0.1]:29931)"
)


def test_ranks_that_lost_their_peer_died_of_its_loss_and_are_not_candidates(tmp_path):
    """Rank 0 SIGKILLed; the survivors' next gloo collective raises "Connection closed by peer"
    0.1-0.3 s later, on the same host, well inside the allowance of a last beat: one story, with
    rank 0 first, no ambiguity, and no "stopped from outside"."""
    ranks = layout(pp=4, tp=1, dp=1)
    ranks[0].stopped, ranks[0].end = T0, None
    for offset, rank in zip([0.1, 0.2], ranks[1:3]):
        rank.stopped, rank.end, rank.end_detail = T0 + offset, "exception", GLOO_PEER_CLOSED
    ranks[3].stopped, ranks[3].end = T0 + 0.3, "sigterm"  # torchrun's answer to rank 0's death
    write_run(tmp_path, ranks)

    code, result = run_json(tmp_path)
    assert code == 1
    first = result["first_failure"]
    assert (first["rank"], first["status"], first["ambiguous_with"]) == (0, "unfinished", [])
    assert result["died_of_first_failure"] == [1, 2, 3] and result["failed_ranks"] == [0, 1, 2]
    ranks_json = by_rank(result)
    assert [ranks_json[r]["died_of"] for r in range(4)] == [None, 0, 0, 0]
    assert [round(ranks_json[r]["stopped_after_first_s"], 2) for r in range(4)] == [0.0, 0.1, 0.2, 0.3]

    code, text, _ = run_cli(tmp_path, "--no-png")
    assert "FIRST FAILURE: rank 0 (pp stage 0, tp 0, dp 0) on node-000 vanished" in text
    assert "cannot tell" not in text and "from outside" not in text
    assert "died of rank 0's loss (3): ranks 1-3, after it (2 raised 'Connection closed by peer'; 1 stopped by " in text
    assert text.count("died of r0's loss") == 3  # the table's finding column
    assert "+0.20 s" in text  # the table's "after first" column, as the JSON's stopped_after_first_s


def test_every_failure_reading_like_a_lost_peer_keeps_them_candidates(tmp_path):
    """The rank that died left no record: the survivors' lost-peer exceptions are all there is."""
    ranks = layout(pp=2, tp=1, dp=1)
    for offset, rank in zip([0.2, 0.0], ranks):
        rank.stopped, rank.end, rank.end_detail = T0 + offset, "exception", GLOO_PEER_CLOSED
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert code == 1 and result["first_failure"]["rank"] == 1 and result["died_of_first_failure"] == []
    assert result["failed_ranks"] == [1, 0]
    assert any("every failed rank's end says it lost a peer" in note for note in result["notes"]), result["notes"]


def test_clock_skew_makes_close_failures_ambiguous(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=2, gpus_per_node=1), 60.0)  # 4 ranks, one host each
    ranks[2].stopped, ranks[2].end = T0, None
    ranks[1].stopped, ranks[1].end = T0 + 2.5, None  # another host: within 1 s period + 2 s skew
    write_run(tmp_path, ranks)

    code, result = run_json(tmp_path)
    assert code == 1
    first = result["first_failure"]
    assert first["rank"] == 2
    assert [(a["rank"], a["allowance_s"]) for a in first["ambiguous_with"]] == [(1, 4.0)]  # two beats + skew
    code, text, _ = run_cli(tmp_path, "--no-png")
    assert (
        "cannot tell which of rank 2 and rank 1 failed first: they stopped 2.50 s apart on different hosts "
        "(node-002, node-001), within the 4.00 s allowance" in text
    )
    assert "the hosts' clocks may differ by 2 s (--clock-skew-s)" in text

    code, result = run_json(tmp_path, "--clock-skew-s", "0")
    assert result["first_failure"]["rank"] == 2 and result["first_failure"]["ambiguous_with"] == []


def test_same_host_needs_no_skew_allowance(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=1), 60.0)  # both on node-000
    ranks[0].stopped, ranks[0].end = T0 + 1.5, None
    ranks[1].stopped, ranks[1].end = T0, None
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert result["first_failure"]["rank"] == 1
    assert [a["allowance_s"] for a in result["first_failure"]["ambiguous_with"]] == [2.0]  # two beats, one clock
    ranks[0].stopped = T0 + 2.5
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert result["first_failure"]["ambiguous_with"] == []


def test_all_closed_exits_0_with_no_first_failure(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=2), 10.0, reason="close")
    ranks[3].end = "sigterm"
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert code == 0 and result["first_failure"] is None and result["failed_ranks"] == []
    assert result["sentence"] == (
        "no failure: all 4 ranks recorded a clean end (3 closed by the run, 1 stopped by SIGTERM)"
    )
    assert {entry["status"] for entry in result["ranks"]} == {"closed"}


def test_an_exception_is_a_failure_but_an_earlier_unfinished_rank_wins(tmp_path):
    ranks = closed_after(layout(pp=3, tp=1, dp=1), 30.0)
    ranks[0].stopped, ranks[0].end = T0 + 10.0, "exception"
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert code == 1 and result["first_failure"]["rank"] == 0
    assert result["first_failure"]["status"] == "closed" and result["first_failure"]["end_reason"] == "exception"
    assert "exited through an unhandled exception" in result["sentence"] and "simulated" in result["sentence"]
    ranks[2].stopped, ranks[2].end = T0, None
    write_rank(tmp_path, ranks[2])
    code, result = run_json(tmp_path)
    assert (result["first_failure"]["rank"], result["first_failure"]["status"]) == (2, "unfinished")
    assert result["failed_ranks"] == [2, 0]


def test_json_schema(tmp_path):
    ranks = closed_after(layout(pp=2, tp=2, dp=1), 10.0)
    ranks[1].stopped, ranks[1].end = T0, None
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert code == 1
    assert set(result) >= {
        "run_id",
        "world_size",
        "sentence",
        "first_failure",
        "ranks",
        "missing_ranks",
        "unreadable_files",
        "ignored_runs",
        "failed_ranks",
        "png",
    }
    assert result["run_id"] == "sim-run" and result["world_size"] == 4 and result["png"] is None
    assert [entry["rank"] for entry in result["ranks"]] == [0, 1, 2, 3]
    for entry in result["ranks"]:
        assert set(entry) >= {
            "rank",
            "pp_rank",
            "tp_rank",
            "dp_rank",
            "host",
            "status",
            "last_iteration",
            "end_reason",
            "last_alive",
            "peak_reserved_gb",
            "headroom_gb",
            "host_rss_gb",
            "host_available_gb",
            "probable_host_oom_kill",
            "problems",
            "file",
        }
        assert entry["status"] in ("closed", "cuda_oom", "unfinished")
        assert isinstance(entry["last_iteration"], int) and isinstance(entry["pp_rank"], int)
    assert set(result["first_failure"]) >= {"rank", "status", "sentence", "time", "ambiguous_with"}
    json.loads(json.dumps(result), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))


def test_run_dir_above_the_record_dir_and_png(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=2), 10.0)
    ranks[2].stopped, ranks[2].end = T0, None
    write_run(tmp_path / "job" / "logs" / "memory_records", ranks)
    (tmp_path / "job" / "checkpoints").mkdir()
    code, text, _ = run_cli(tmp_path / "job")
    assert code == 1 and "FIRST FAILURE: rank 2 " in text
    png = tmp_path / "job" / "memory_postmortem.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot of the last records per stage and when each rank stopped: {png}" in text
    assert b"first failure rank 2 (unfinished)" in png.read_bytes()  # the PNG's Title text

    other = tmp_path / "elsewhere.png"
    code, result = run_json(tmp_path / "job", "--png", other)
    assert result["png"] == str(other) and other.stat().st_size > 10_000


def test_a_read_only_run_dir_still_gets_its_post_mortem(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=1), 10.0)
    write_run(tmp_path / "copy", ranks)
    (tmp_path / "copy").chmod(0o555)
    try:
        if os.access(tmp_path / "copy", os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        code, text, err = run_cli(tmp_path / "copy")
        assert code == 0 and "no failure" in text
        assert "warning: no plot written" in err and "--png PATH" in err
    finally:
        (tmp_path / "copy").chmod(0o755)


# ---- bad input ----------------------------------------------------------------------------


def corrupt(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def test_torn_slots_truncated_and_garbage_files_are_named_and_the_other_ranks_reported(tmp_path):
    ranks = closed_after(layout(pp=4, tp=1, dp=2), 10.0)
    ranks[6].stopped, ranks[6].end = T0, None
    write_run(tmp_path, ranks)
    name = records.file_name
    slot = records.DEFAULT_SLOT_BYTES
    corrupt(tmp_path / name(1), records.record_offset(1, records.DEFAULT_SLOTS, slot) + 40, b"XXXX")  # torn slot
    corrupt(tmp_path / name(2), records.HEADER_BYTES + 30, b"\xff\xfe")  # torn liveness
    with open(tmp_path / name(3), "r+b") as handle:  # truncated in its third record slot
        handle.truncate(records.RECORDS_AT + 2 * slot + 100)
    (tmp_path / name(4)).write_bytes(b"this is not a record file" * 300)  # garbage header
    (tmp_path / name(5)).write_bytes(b"")  # empty
    with open(tmp_path / name(7), "r+b") as handle:  # truncated inside its header
        handle.truncate(50)

    code, result = run_json(tmp_path)
    assert code == 1 and result["first_failure"]["rank"] == 6  # still found
    entries = by_rank(result)
    assert sorted(entries) == [0, 1, 2, 6]  # a truncated copy is unreadable: its lost part may hold its end
    assert entries[1]["problems"] == ["record slot 1: slot checksum mismatch (torn or corrupted write)"]
    assert entries[1]["last_iteration"] == 30 and entries[1]["status"] == "closed"  # the end record survived
    assert entries[2]["problems"][0].startswith("liveness slot: ")
    assert entries[2]["last_alive"] == pytest.approx(T0 + 10.0)  # from its end record
    unreadable = {entry["rank"]: entry["error"] for entry in result["unreadable_files"]}
    assert set(unreadable) == {3, 4, 5, 7}
    assert unreadable[3].startswith(
        f"file truncated: {records.RECORDS_AT + 2 * slot + 100} of "
        f"{records.file_bytes(records.DEFAULT_SLOTS, slot)} bytes"
    )
    assert unreadable[4].startswith("header: slot prefix is not")
    assert unreadable[5] == "empty file (0 bytes)"
    assert unreadable[7] == "header: slot is truncated or its prefix is malformed"
    assert result["missing_ranks"] == [3, 4, 5, 7]

    code, text, _ = run_cli(tmp_path, "--no-png")
    assert "unreadable record files (4; their ranks are not in the table):" in text
    assert f"{tmp_path / name(5)}: empty file (0 bytes) (rank 5 by its name)" in text
    assert "ranks with torn or corrupted slots (2; their other slots are used):" in text
    assert "ranks with no record file" not in text  # the unreadable ones are not counted twice


def test_records_of_two_runs_report_the_newest_and_name_the_other(tmp_path):
    old = closed_after(layout(pp=2, tp=1, dp=1), -7200.0, reason="close")
    write_run(tmp_path / "records", old, run_id="old-run")  # its headers' start: on the scenario's clock, 2 h earlier
    new = closed_after(layout(pp=4, tp=1, dp=1), 10.0)
    new[1].stopped, new[1].end = T0, None
    write_run(tmp_path / "records" / "resumed", new, run_id="new-run")

    code, result = run_json(tmp_path)
    assert code == 1 and result["run_id"] == "new-run" and len(result["ranks"]) == 4
    assert [(run["run_id"], run["files"], run["dirs"]) for run in result["ignored_runs"]] == [
        ("old-run", 2, [str(tmp_path / "records")])
    ]
    code, text, _ = run_cli(tmp_path, "--no-png")
    assert "ignored 2 record file(s) of 1 other run(s) in the same folder (reported: run new-run" in text
    assert "run old-run, started " in text and f"2 file(s) in {tmp_path / 'records'}" in text

    code, result = run_json(tmp_path, "--run-id", "old-run")
    assert code == 0 and result["run_id"] == "old-run" and result["first_failure"] is None
    code, _, err = run_cli(tmp_path, "--run-id", "nope")
    assert code == 2 and "no records of run 'nope'; runs found: " in err and "new-run (4 files)" in err


def test_a_folder_without_records_or_a_bad_option_is_a_usage_error(tmp_path):
    (tmp_path / "tensorboard").mkdir()
    code, _, err = run_cli(tmp_path)
    assert code == 2 and f"{tmp_path}: no flight records (rank-NNNNN.memrec) found below it" in err
    code, _, err = run_cli(tmp_path / "missing")
    assert code == 2 and "no such directory" in err
    (tmp_path / "rank-00000.memrec").write_bytes(b"\0" * 5000)
    code, _, err = run_cli(tmp_path)
    assert code == 2 and "none readable" in err and "empty header: the file was created but never written" in err
    code, _, err = run_cli(tmp_path, "--clock-skew-s", "-1")
    assert code == 2 and "a number of seconds >= 0" in err


def test_large_world_table_shows_the_failure_its_pipeline_and_host_and_a_stage_summary(tmp_path):
    ranks = closed_after(layout(pp=4, tp=2, dp=16), 10.0)  # 128 ranks, 16 hosts
    victim = ranks[77]  # pp 2, tp 1, dp 6 on node-009
    victim.stopped, victim.end = T0, None
    write_run(tmp_path, ranks, slots=4)
    code, text, _ = run_cli(tmp_path, "--no-png")
    assert code == 1
    table = text.split("per pipeline stage:")[0]
    shown = {int(line.split()[0]) for line in table.splitlines() if line.strip()[:1].isdigit()}
    assert shown == {13, 45, 77, 109} | set(range(72, 80))  # its pipeline (tp 1, dp 6) and node-009
    assert "showing 11 of 128 ranks" in text
    summary = text.split("per pipeline stage:")[1].splitlines()
    assert len([line for line in summary if line.strip()[:1].isdigit()]) == 4
    code, text, _ = run_cli(tmp_path, "--no-png", "--all")
    assert "showing" not in text and "per pipeline stage" not in text
    assert len([line for line in text.splitlines() if line.strip()[:1].isdigit() and "node-" in line]) == 128


def test_report_command_mentions_the_post_mortem(tmp_path):
    write_run(tmp_path / "memory_records", closed_after(layout(pp=2, tp=1, dp=1), 10.0))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", str(tmp_path)])
    assert code == 2  # no TensorBoard events here
    from nemo_memlog.commands import postmortem_command

    assert (
        f"flight records found under {tmp_path / 'memory_records'}: `{postmortem_command(tmp_path)}`" in err.getvalue()
    )


@pytest.mark.processes
def test_the_command_imports_no_torch(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=1), 10.0)
    ranks[0].stopped, ranks[0].end = T0, None
    write_run(tmp_path, ranks)
    code = (
        "import sys, runpy; sys.argv = ['nemo-memlog', 'postmortem', sys.argv[1], '--json'];\n"
        "try:\n    runpy.run_module('nemo_memlog.cli', run_name='__main__')\n"
        "except SystemExit as e:\n    assert 'torch' not in sys.modules, 'torch imported'; raise"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["first_failure"]["rank"] == 0


def test_ranks_that_all_stopped_together_are_called_a_stop_from_outside(tmp_path):
    ranks = layout(pp=2, tp=2, dp=2, gpus_per_node=4)  # 8 ranks, 2 hosts, all SIGKILLed at once
    for offset, rank in zip([0.3, 0.1, 0.5, 0.2, 0.6, 0.0, 0.4, 0.7], ranks):
        rank.stopped, rank.end = T0 + offset, None
    write_run(tmp_path, ranks)
    code, text, _ = run_cli(tmp_path, "--no-png")
    assert code == 1 and "FIRST FAILURE: rank 5 " in text
    assert "cannot tell which of rank 5 and rank 1 failed first: they stopped 0.10 s apart on different hosts" in text
    assert (
        "; 6 more failed rank(s) stopped within the same allowance. Most ranks stopped together: the job was "
        "probably stopped from outside (scheduler, node loss)" in text
    )


@pytest.mark.processes
def test_the_benchmark_still_runs():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_postmortem.py"), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote 64 record files for 64 ranks" in done.stdout
    assert "| 64 | " in done.stdout and "slowest run: " in done.stdout


def test_an_end_followed_by_records_does_not_count(tmp_path):
    """After our SIGTERM handler marked the end, a framework may train on; a SIGKILL then leaves
    step records after the end marker: that rank did not end."""
    ranks = closed_after(layout(pp=2, tp=1, dp=1), 10.0, reason="close")
    path = write_rank(tmp_path, ranks[0])
    ranks[1].end, ranks[1].stopped = None, T0
    write_rank(tmp_path, ranks[1])
    slots, slot = records.DEFAULT_SLOTS, records.DEFAULT_SLOT_BYTES
    code, result = run_json(tmp_path)
    assert by_rank(result)[0]["status"] == "closed" and result["first_failure"]["rank"] == 1
    with open(path, "r+b") as handle:  # rank 0: sigterm end at seq 3, then a step record at seq 4
        handle.seek(records.record_offset(3, slots, slot))
        handle.write(
            records.encode(
                {
                    "seq": 3,
                    "kind": "end",
                    "time": T0 + 5,
                    "iteration": 30,
                    "report": {},
                    "reason": "sigterm",
                    "detail": "",
                },
                slot,
            )
        )
        handle.seek(records.record_offset(4, slots, slot))
        handle.write(
            records.encode(
                {"seq": 4, "kind": "step", "time": T0 + 6, "iteration": 40, "report": {"peak_reserved_gb": 50.0}}, slot
            )
        )
    code, result = run_json(tmp_path)
    rank0 = by_rank(result)[0]
    assert (rank0["status"], rank0["end_reason"], rank0["last_iteration"], rank0["peak_reserved_gb"]) == (
        "unfinished",
        None,
        40,
        50.0,
    )


def test_a_rank_killed_at_its_cgroup_limit_is_said_so_against_the_limit_not_the_node(tmp_path):
    """Four ranks on one node in a 2.85 GB memory cgroup: the lead sentence and the table speak of
    the limit, and usage at 95% of it or more at the last beat is evidence of the OOM killer."""
    ranks = closed_after(layout(pp=4, tp=1, dp=1), 5.0)
    for rank in ranks:
        rank.host_limit_gb, rank.host_limit_used_gb, rank.host_rss_gb = 2.85, 2.10, 0.6
    victim = ranks[2]
    victim.stopped, victim.end, victim.host_rss_gb, victim.host_limit_used_gb = T0, None, 1.5, 2.84
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert code == 1 and result["first_failure"]["rank"] == 2
    assert "with host RSS 1.5 GB, the job's memory cgroup at 2.84 of its 2.85 GB limit while " in result["sentence"]
    assert "its memory cgroup was at 2.84 of its 2.85 GB limit at its last beat" in result["sentence"]
    assert "probably the kernel's OOM killer" in result["sentence"] and "of 512 GB" not in result["sentence"]
    assert by_rank(result)[2]["host_limit_gb"] == 2.85 and by_rank(result)[0]["host_limit_used_gb"] == 2.10
    code, text, _ = run_cli(tmp_path, "--no-png")
    header = next(line for line in text.splitlines() if line.startswith("rank "))
    assert "cgroup used" in header and "limit" in header


def test_a_cuda_oom_of_a_run_that_passed_its_model_says_what_the_memory_was_made_of(tmp_path):
    ranks = closed_after(layout(pp=2, tp=1, dp=1), 30.0)
    ranks[0].stopped, ranks[0].end = T0, "exception"
    ranks[0].oom = dict(FRAGMENTED_OOM, reserved_free=int(0.5e9), largest_free_block=int(0.3e9))
    ranks[0].composition = {
        "params_gb": 6.1,
        "grads_gb": 6.1,
        "optimizer_state_gb": 18.3,
        "model_state_gb": 30.5,
        "activations_gb": 40.0,
        "temporaries_gb": 4.0,
        "allocator_slack_gb": 3.1,
    }
    ranks[0].peak_reserved_gb = 77.6
    write_run(tmp_path, ranks)
    code, result = run_json(tmp_path)
    assert code == 1 and result["first_failure"]["rank"] == 0
    assert (
        "; of 78.70 GB, 30.50 GB is model state (6.10 GB parameters, 6.10 GB gradients, 18.30 GB optimizer), "
        "40.00 GB activations, 4.00 GB temporaries, 3.10 GB allocator slack, 1.10 GB outside the allocator"
        in result["sentence"]
    ), result["sentence"]


def test_png_colours_each_stage_apart_and_marks_the_first_failure_another_way(tmp_path, monkeypatch):
    """No stage drawn red, none the same colour as another: the first failure is a black X on its
    last record, named beside it, never a red line over its stage's (issue 40)."""
    from matplotlib.colors import to_hex

    from nemo_memlog.offline.postmortem import plot as postmortem_plot

    figures = []
    real = postmortem_plot.save
    monkeypatch.setattr(postmortem_plot, "save", lambda f, p, t: figures.append(f) or real(f, p, t))
    ranks = closed_after(layout(pp=4, tp=1, dp=1), 10.0)
    ranks[0].stopped, ranks[0].end = T0, None
    write_run(tmp_path / "job", ranks)
    code, text, _ = run_cli(tmp_path / "job")
    assert code == 1 and "FIRST FAILURE: rank 0 " in text
    top = figures[-1].axes[0]
    stages = [line for line in top.get_lines() if line.get_label().startswith("stage ")]
    colours = [to_hex(line.get_color()) for line in stages]
    assert len(stages) == 4 and len(set(colours)) == 4
    assert to_hex("tab:red") not in colours and to_hex("red") not in colours
    [marker] = [line for line in top.get_lines() if line.get_label().startswith("first failure: rank 0")]
    assert marker.get_marker() == "X" and to_hex(marker.get_markeredgecolor()) == to_hex("black")
    assert any(t.get_text().startswith("first failure: rank 0, stage 0") for t in top.texts)
