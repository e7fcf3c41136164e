"""The offline commands on records that are broken, hostile or odd (issue 39): files other people's
jobs wrote and copied between clusters. Real files in tmp_path, through the real command (cli.main,
and once as a process for a closed pipe). None of them may hang, grow without bound, or end in a
traceback: each bad file is named with what is wrong with it, the other ranks are still reported,
and the exit status is 2 when nothing usable is left."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from nemo_memlog import advice
from nemo_memlog.cli import main
from nemo_memlog.failure import records
from nemo_memlog.measure import layer_record
from nemo_memlog.offline import advise
from nemo_memlog.offline.postmortem.render import format_text
from nemo_memlog.offline.postmortem.state import Postmortem, RankState
from nemo_memlog.offline.rank_files import RankFile
from nemo_memlog.testing.flight_sim import layout, write_run

ROOT = Path(__file__).resolve().parents[1]
T0 = time.time() - 3600.0


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*map(str, argv)])
    assert "Traceback" not in err.getvalue()
    return code, out.getvalue(), err.getvalue()


def strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# ---- flight records: postmortem ------------------------------------------------------------


def closed_run(folder: Path, pp: int = 4) -> list:
    ranks = layout(pp=pp, tp=1, dp=1)
    for rank in ranks:
        rank.stopped, rank.end = T0 + 10.0, "close"
    write_run(folder, ranks)
    return ranks


def rewrite_header(path: Path, **fields) -> None:
    data = bytearray(path.read_bytes())
    header = records.decode(bytes(data[: records.HEADER_BYTES]))
    header.update(fields)
    data[: records.HEADER_BYTES] = records.encode(header, records.HEADER_BYTES)
    path.write_bytes(bytes(data))


def postmortem_json(folder: Path) -> tuple[int, dict]:
    code, out, _ = cli("postmortem", folder, "--json")
    return code, strict_json(out)


@pytest.mark.parametrize(
    "field, value",
    [
        ("world_size", 1e15),  # seen: 18.5 GB in 60 s
        ("world_size", 10**15),
        ("world_size", "4"),
        ("rank", "1"),
        ("rank", -1),
        ("rank", 99),  # not below world_size
        ("rank", True),
        ("slot_bytes", 1e300),
        ("slot_bytes", 10**12),
        ("slots", 0),
        ("liveness_period_s", "1s"),
        ("liveness_period_s", float("inf")),
        ("started", "yesterday"),
        ("started", [1, 2]),
        ("run_id", {"a": 1}),
        ("pp_rank", -3),
        ("host", 7),
    ],
)
def test_a_header_field_of_the_wrong_type_or_range_is_named_and_the_other_ranks_reported(tmp_path, field, value):
    closed_run(tmp_path)
    bad = tmp_path / records.file_name(1)
    rewrite_header(bad, **{field: value})
    started = time.monotonic()
    code, result = postmortem_json(tmp_path)
    assert time.monotonic() - started < 30
    assert code == 0 and sorted(entry["rank"] for entry in result["ranks"]) == [0, 2, 3]
    [unreadable] = result["unreadable_files"]
    assert unreadable["path"] == str(bad) and unreadable["rank"] == 1
    assert f"header field {field!r}" in unreadable["error"]
    code, text, _ = cli("postmortem", tmp_path, "--no-png")
    assert f"{bad}: header field {field!r}" in text

    for other in (0, 2, 3):  # nothing usable left: exit 2, the file and field named
        (tmp_path / records.file_name(other)).unlink()
    code, _, err = cli("postmortem", tmp_path, "--no-png")
    assert code == 2 and str(bad) in err and f"header field {field!r}" in err


def test_a_fifo_a_device_and_a_huge_sparse_file_named_like_records_are_not_read(tmp_path):
    closed_run(tmp_path)
    os.mkfifo(tmp_path / records.file_name(4))  # reading it would wait forever
    os.symlink("/dev/zero", tmp_path / records.file_name(5))  # reading it would never end
    with open(tmp_path / records.file_name(6), "wb") as handle:  # 64 GB, all holes
        handle.truncate(64 << 30)
    code, result = postmortem_json(tmp_path)
    assert code == 0 and len(result["ranks"]) == 4
    errors = {entry["rank"]: entry["error"] for entry in result["unreadable_files"]}
    assert errors[4].startswith("a FIFO, not a regular file")
    assert errors[5].startswith("a character device, not a regular file")
    assert errors[6].startswith(f"{64 << 30} bytes, more than the")


def test_a_truncated_copy_of_a_rank_that_closed_is_unreadable_never_the_first_failure(tmp_path):
    closed_run(tmp_path)
    path = tmp_path / records.file_name(2)
    with open(path, "r+b") as handle:  # a partial copy: its end record was in the part lost
        handle.truncate(records.RECORDS_AT + records.DEFAULT_SLOT_BYTES + 10)
    code, result = postmortem_json(tmp_path)
    assert code == 0 and result["first_failure"] is None
    [entry] = result["unreadable_files"]
    assert entry["rank"] == 2 and entry["error"].startswith("file truncated: ")


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,  # a nesting depth bomb
        b'{"seq":' + b"9" * 5000 + b',"kind":"step"}',  # an integer too long to convert
        b"[1, 2, 3]",  # JSON, but a list
        b"42",
        b'{"seq": 3, "kind": "end", "time": "NaN", "reason": ["close"], "report": 5}',
        b'{"seq": 4, "kind": "oom", "time": NaN, "bytes_requested": "big", "report": {"peak_reserved_gb": "x"}}',
    ],
)
def test_a_hostile_record_slot_is_named_and_the_rank_still_reported(tmp_path, body):
    closed_run(tmp_path)
    path = tmp_path / records.file_name(3)
    slot_bytes = 1 << 20 if len(body) > 2000 else records.DEFAULT_SLOT_BYTES
    data = bytearray(path.read_bytes())
    if slot_bytes != records.DEFAULT_SLOT_BYTES:  # a ring of one large slot
        rewrite_header(path, slots=1, slot_bytes=slot_bytes)
        data = bytearray(path.read_bytes()[: records.RECORDS_AT]) + bytearray(slot_bytes)
    head = b"%08x %08x\n" % (len(body), zlib.crc32(body))
    at = records.RECORDS_AT
    data[at : at + len(head) + len(body)] = head + body
    path.write_bytes(bytes(data))
    code, result = postmortem_json(tmp_path)
    assert code in (0, 1)
    ranks = {entry["rank"] for entry in result["ranks"]} | {e["rank"] for e in result["unreadable_files"]}
    assert ranks == {0, 1, 2, 3}
    code, text, _ = cli("postmortem", tmp_path, "--no-png")
    assert code in (0, 1) and "FIRST FAILURE" in text


def test_a_records_text_cannot_forge_a_line_or_a_terminal_escape(tmp_path):
    """A header's host holding "\\n\\nFIRST FAILURE: rank 99" and a terminal escape is shown escaped,
    in the sentence and the table: the post-mortem has one FIRST FAILURE line, rank 99 none."""
    closed_run(tmp_path, pp=2)
    rewrite_header(tmp_path / records.file_name(1), host="n1\n\nFIRST FAILURE: rank 99\r\x1b[2J")
    code, text, _ = cli("postmortem", tmp_path, "--no-png", "--all")
    assert code in (0, 1)
    assert [line for line in text.splitlines() if line.startswith("FIRST FAILURE: rank 99")] == []
    assert text.count("\nFIRST FAILURE: ") == 1 and "\x1b" not in text and "\r" not in text
    assert "n1\\n\\nFIRST FAILURE: rank 99\\r\\x1b[2J" in text
    code, result = postmortem_json(tmp_path)  # JSON carries the text as written: its escapes are JSON's
    assert any(entry.get("host") == "n1\n\nFIRST FAILURE: rank 99\r\x1b[2J" for entry in result["ranks"])


@pytest.mark.parametrize("value", [-3.0, math.inf])
def test_a_flight_record_with_an_infinite_or_negative_size_is_named_and_not_shown(tmp_path, value):
    """NaN is a statistic the rank lacks (report_memory writes it); -3 GB or Inf cannot be a size."""
    closed_run(tmp_path, pp=2)
    path = tmp_path / records.file_name(1)
    record = {"seq": 999, "kind": "step", "time": T0 + 5.0, "iteration": 9, "report": {"peak_host_rss_gb": value}}
    body = json.dumps(record, allow_nan=True).encode()  # the newest step: the one the post-mortem shows
    data = bytearray(path.read_bytes())
    head = b"%08x %08x\n" % (len(body), zlib.crc32(body))
    data[records.RECORDS_AT : records.RECORDS_AT + len(head) + len(body)] = head + body
    path.write_bytes(bytes(data))
    code, text, _ = cli("postmortem", tmp_path, "--no-png", "--all")
    assert code in (0, 1) and "field 'report.peak_host_rss_gb'" in text and "is not a size" in text, text
    shown = "\n".join(line for line in text.splitlines() if "is not a size" not in line)
    assert "-3.00 GB" not in shown and "inf" not in shown.lower()


@pytest.mark.processes
def test_a_closed_pipe_ends_quietly(tmp_path):
    closed_run(tmp_path, pp=2)
    process = subprocess.Popen(
        [sys.executable, "-m", "nemo_memlog.cli", "postmortem", str(tmp_path), "--no-png", "--all"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    process.stdout.close()  # `| head` that has read all it wants
    err = process.stderr.read().decode()
    assert process.wait(timeout=60) in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_closed_pipe_in_process_returns_141(tmp_path, monkeypatch):
    closed_run(tmp_path, pp=2)

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["postmortem", str(tmp_path), "--no-png"]) == 141


def synthetic_postmortem(count: int) -> Postmortem:
    states = []
    for rank in range(count):
        header = {"run_id": "r", "rank": rank, "world_size": count, "pp_rank": rank % 4, "tp_rank": 0}
        header |= {"dp_rank": rank // 4, "host": f"node-{rank // 8:04d}", "liveness_period_s": 1.0}
        file = RankFile(Path(f"rank-{rank:05d}.memrec"), header, {"alive": T0 + rank * 1e-3}, [], [])
        end = {"kind": "end", "reason": "sigterm", "time": T0 + 5.0, "detail": "x"}
        states.append(RankState(file, "closed", end, None, 30, T0 + rank * 1e-3, {"peak_reserved_gb": 40.0}, 40.0))
    first = RankState(states[0].file, "unfinished", None, None, 30, T0, {}, None)
    states[0] = first
    return Postmortem(Path("run"), "r", states, first, None, [first], [], [], [], [], 2.0)


def test_the_all_table_is_linear_in_ranks():
    def seconds(count: int) -> float:
        postmortem = synthetic_postmortem(count)
        started = time.perf_counter()
        text = format_text(postmortem, all_rows=True)
        assert text.count("\n") > count
        return time.perf_counter() - started

    seconds(200)  # warm
    small = min(seconds(500) for _ in range(3))
    large = min(seconds(5000) for _ in range(2))
    assert large / small < 30, (small, large)  # linear: about 10; the quadratic width was about 100


# ---- per-layer records: advise -------------------------------------------------------------


def layer_file(folder: Path, rank: int, pp: int, pp_rank: int, dp: int = 1, **run) -> Path:
    record = {
        "rank": rank,
        "world_size": pp * dp,
        "pp_rank": pp_rank,
        "pp_size": pp,
        "tp_rank": 0,
        "tp_size": 1,
        "dp_rank": rank // pp,
        "dp_size": dp,
        "iteration": 10,
        "time": T0,
        "run": {"microbatches": 4, "micro_batch_size": 2, **run},
        "stage": {
            "params_gb": 1.0,
            "grads_gb": 1.0,
            "optimizer_state_gb": 2.0,
            "model_state_gb": 4.0,
            "activations_gb": 2.0 * (pp - pp_rank),
            "activations_per_microbatch_gb": 2.0,
            "microbatches_in_flight": min(pp - pp_rank, 4),
            "microbatches": 4,
            "chunks": 1,
            "peak_host_rss_gb": 12.0,
            "host_total_gb": 64.0,
        },
        "layers": [
            {
                "name": f"layer{pp_rank}",
                "kind": "layer",
                "chunk": 0,
                "number": pp_rank,
                "params_gb": 1.0,
                "grads_gb": 1.0,
                "optimizer_state_gb": 2.0,
                "activations_per_microbatch_gb": 2.0,
                "input_per_microbatch_gb": 0.1,
            }
        ],
    }
    return layer_record.write(folder, record)


def advise_cli(folder, *extra) -> tuple[int, str, str]:
    return cli("advise", folder, "--no-png", *extra)


def test_a_good_synthetic_record_folder_is_advised_on(tmp_path):
    for rank in range(2):
        layer_file(tmp_path, rank, pp=2, pp_rank=rank)
    code, out, err = advise_cli(tmp_path, "--json", "--capacity-gb", "40")
    assert code == 0, err
    result = strict_json(out)
    assert [row["stage"] for row in result["stages"]] == [0, 1] and result["null_reasons"] == {}


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: os.symlink("/dev/zero", p), "a character device, not a regular file"),
        (lambda p: os.mkfifo(p), "a FIFO, not a regular file"),
        (lambda p: open(p, "wb").truncate(64 << 30), "bytes, more than the"),
        (lambda p: p.write_text(""), "not JSON"),
        (lambda p: p.write_text("[1, 2]"), "JSON list, not an object"),
        (lambda p: p.write_text("7"), "JSON int, not an object"),
        (lambda p: p.write_text("[" * 200_000), "not JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe{}"), "not JSON"),
        (lambda p: p.write_text('{"format": "nemo_memlog.layers", "version": "2"}'), "field 'version'"),
    ],
)
def test_a_layer_record_that_is_no_record_is_named(tmp_path, make, words):
    layer_file(tmp_path, 0, pp=2, pp_rank=0)
    bad = tmp_path / layer_record.file_name(1)
    make(bad)
    code, _, err = advise_cli(tmp_path)
    assert code == 2 and str(bad) in err and words in err, err


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("pp_rank",), "1", "pp_rank"),
        (("pp_size",), 1e15, "pp_size"),
        (("run",), 5, "run"),
        (("run", "micro_batch_size"), "NaN", "run.micro_batch_size"),
        (("run", "microbatches"), 1e12, "run.microbatches"),
        (("stage",), [], "stage"),
        (("stage", "params_gb"), "1", "stage.params_gb"),
        (("stage", "params_gb"), float("inf"), "stage.params_gb"),
        (("stage", "microbatches_in_flight"), -1, "stage.microbatches_in_flight"),
        (("layers",), {"a": 1}, "layers"),
        (("layers", 0, "activations_per_microbatch_gb"), None, "layers[0].activations_per_microbatch_gb"),
    ],
)
def test_a_layer_record_field_of_the_wrong_type_is_named_with_its_file(tmp_path, path, value, field):
    layer_file(tmp_path, 0, pp=2, pp_rank=0)
    bad = layer_file(tmp_path, 1, pp=2, pp_rank=1)
    record = json.loads(bad.read_text())
    inner = record
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    bad.write_text(json.dumps(record))
    code, _, err = advise_cli(tmp_path)
    assert code == 2 and f"{bad}: field {field!r}" in err, err


@pytest.mark.parametrize(
    "field, value",
    [
        ("peak_host_rss_gb", math.nan),  # advise predicted 9.6 MB from it where 851 MB was right, "fits: yes"
        ("model_state_gb", math.nan),
        ("peak_host_rss_gb", math.inf),
        ("params_gb", -1.0),
        ("layers", -0.5),
    ],
)
def test_nan_inf_or_a_negative_size_is_refused_by_advise_and_report_naming_file_and_field(tmp_path, field, value):
    """A size that cannot be one: advise and report --records exit 2 naming the file and the field
    (report --records used to print the run and exit 0)."""
    records = tmp_path / "records"
    layer_file(records, 0, pp=2, pp_rank=0)
    bad = layer_file(records, 1, pp=2, pp_rank=1)
    record = json.loads(bad.read_text())
    if field == "layers":
        record["layers"][0]["activations_per_microbatch_gb"] = value
        named = "layers[0].activations_per_microbatch_gb"
    else:
        record["stage"][field] = value
        named = f"stage.{field}"
    bad.write_text(json.dumps(record))
    code, out, err = advise_cli(records, "--capacity-gb", "40")
    assert code == 2 and f"{bad}: field {named!r}" in err and "fits" not in out, err
    run = tmp_path / "run"
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(run)) as writer:
        writer.add_scalar("memory/pp_stage_0/peak_host_rss_gb", 1.0, 1)
    code, out, err = cli("report", run, "--records", records, "--png", tmp_path / "r.png")
    assert code == 2 and f"{bad}: field {named!r}" in err, err


def sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def test_one_read_budget_for_a_runs_files_together(tmp_path):
    """Five per-layer records of 60 MB, each under the 64 MB a file may be: together over the run's
    read budget, refused from their sizes before any is read (four such files took 37 s and 808 MB)."""
    for rank in range(5):
        sparse(tmp_path / layer_record.file_name(rank), 60 << 20)
    started = time.monotonic()
    code, out, err = advise_cli(tmp_path)
    assert code == 2 and out == "" and time.monotonic() - started < 5, err
    assert "5 per-layer records hold 315 MB together, more than the 268 MB read of one run" in err, err
    assert str(tmp_path / layer_record.file_name(0)) in err
    flights = tmp_path / "flights"
    closed_run(flights, pp=2)
    for rank in range(2, 7):
        sparse(flights / records.file_name(rank), 60 << 20)
    code, _, err = cli("postmortem", flights, "--no-png")
    assert code == 2 and "flight record files (.memrec) hold 315 MB together" in err, err


def test_a_long_read_says_how_far_it_is(tmp_path, monkeypatch):
    from nemo_memlog import bounded

    for rank in range(2):
        layer_file(tmp_path, rank, pp=2, pp_rank=rank)
    said: list[str] = []
    monkeypatch.setattr(bounded, "PROGRESS_EVERY_S", 0.0)  # as a read of thousands of files does after 2 s
    budget = bounded.ReadBudget(say=said.append)
    assert len(layer_record.read_folder_files(tmp_path, budget)) == 2
    assert said == ["reading per-layer records: 1 of 2 files, 0 s", "reading per-layer records: 2 of 2 files, 0 s"]
    assert budget.used == sum(path.stat().st_size for path in tmp_path.glob("rank-*.layers.json"))


def test_stale_records_of_another_layout_are_refused_naming_both(tmp_path):
    for rank in range(4):  # an old PP 4 run
        layer_file(tmp_path, rank, pp=4, pp_rank=rank)
    for rank in range(2):  # this PP 2 run, written over ranks 0 and 1 only
        layer_file(tmp_path, rank, pp=2, pp_rank=rank)
    code, out, err = advise_cli(tmp_path)
    assert code == 2 and "stage 3" not in out
    assert "more than one run layout" in err and "PP 2 x TP 1 x DP 1 (world size 2)" in err
    assert "PP 4 x TP 1 x DP 1 (world size 4)" in err and "rank-00002.layers.json" in err


def test_a_missing_stage_is_refused_not_predicted_from_the_others(tmp_path):
    layer_file(tmp_path, 1, pp=2, pp_rank=1)
    code, out, err = advise_cli(tmp_path)
    assert code == 2 and "fits" not in out
    assert "no per-layer record of pipeline stage(s) 0 of PP 2" in err and "rank-00001.layers.json" in err


@pytest.mark.parametrize("run", [{"micro_batch_size": 10**9}, {"microbatches": 10**12}, {"microbatches": 999_999_937}])
def test_huge_stated_sizes_are_searched_in_bounded_time(tmp_path, run):
    for rank in range(2):
        layer_file(tmp_path, rank, pp=2, pp_rank=rank, **run)
    started = time.monotonic()
    code, out, err = advise_cli(tmp_path, "--json", "--capacity-gb", "1000")
    assert code == 0, err
    assert time.monotonic() - started < 20
    assert isinstance(strict_json(out)["max_micro_batch_size"], (int, type(None)))


def test_the_bisection_finds_what_trying_every_size_finds(tmp_path, monkeypatch):
    import importlib

    predict = importlib.import_module("nemo_memlog.advice.predict")

    for rank in range(2):
        layer_file(tmp_path, rank, pp=2, pp_rank=rank, microbatches=64, micro_batch_size=64)
    run = advise.load(tmp_path, capacity_gb=300.0)
    every = advice.max_micro_batch_size(run)
    monkeypatch.setattr(predict, "_PREDICT_EACH", 1)
    assert advice.max_micro_batch_size(run) == every and every[0] is not None
    no_count = advise.load(tmp_path, capacity_gb=300.0)
    no_count = type(no_count)(**{**no_count.__dict__, "microbatches": None})
    found = advice.max_micro_batch_size(no_count)
    monkeypatch.setattr(predict, "_PREDICT_EACH", 1 << 20)
    assert advice.max_micro_batch_size(no_count) == found


def test_advise_json_is_strict_with_a_reason_for_each_null(tmp_path):
    for rank in range(2):
        layer_file(tmp_path, rank, pp=2, pp_rank=rank)
    run = advise.load(tmp_path, capacity_gb=math.inf)
    outcomes = advice.predict(run, [])
    result = strict_json(advise.as_json(advise.Advice(run, [], outcomes, (None, "x"))))
    assert result["capacity_gb"] is None and result["stages"][0]["headroom_gb"] is None
    assert result["null_reasons"]["capacity_gb"] == "not a finite number: inf"
    code, _, err = advise_cli(tmp_path, "--capacity-gb", "inf")
    assert code == 2 and "a number of GB above 0" in err


def test_a_read_only_run_folder_gets_a_warning_not_a_traceback(tmp_path):
    for rank in range(2):
        layer_file(tmp_path / "run", rank, pp=2, pp_rank=rank)
    (tmp_path / "run").chmod(0o555)
    try:
        if os.access(tmp_path / "run", os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        code, out, err = cli("advise", tmp_path / "run")
        assert code == 0 and "largest micro-batch size" in out and "warning: no plot written" in err
    finally:
        (tmp_path / "run").chmod(0o755)
