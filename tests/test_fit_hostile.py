"""``nemo-memlog fit`` against commands that fail it: one that dies at once in a reused --work-dir,
times out, floods a line, writes bad records, prints secrets, or states a size of a million; a
--work-dir that cannot be used. The probes are stub commands (``python -c``: a record written in
well under a second), so each test is a few real launches of fit, not of a job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_memlog import commands
from nemo_memlog.launch import fit as fit_module
from nemo_memlog.launch.fit import words as fit_words
from nemo_memlog.launch.fit.probe import Probe
from nemo_memlog.redaction import command_secrets, environ_secrets
from nemo_memlog.testing.probe_stub import STUB
from nemo_memlog.testing.torchrun import ROOT

FIT = [sys.executable, "-m", "nemo_memlog.cli", "fit"]
SECRETS = ("PASS456", "SECRET123", "COMETKEY1", "KEY789")


def stub(mode: str = "ok", size: str = "{micro_batch_size:2}") -> list[str]:
    return [sys.executable, "-c", STUB, size, mode]


def fit(*args: str, env: dict | None = None, tmp: Path | None = None) -> tuple[int, str, str, float]:
    """fit's exit code, stdout, stderr and seconds (its temporary folders under ``tmp``). A fit that
    hangs (a probe never ended at its timeout, a quadratic read of a long line, 64 million candidates
    predicted one by one) fails at the run's 120 s timeout: no tighter clock bound in these tests."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if tmp is not None:
        environ["TMPDIR"] = str(tmp)
    began = time.monotonic()
    done = subprocess.run([*FIT, *args], env=environ, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def one_object(stdout: str) -> dict:
    out = json.loads(stdout)
    assert isinstance(out, dict)
    return out


@pytest.mark.processes
def test_a_reused_work_dir_never_answers_for_a_command_that_failed_at_once(tmp_path):
    work = tmp_path / "work"
    code, out, err, _ = fit("--capacity-gb", "8", "--work-dir", str(work), "--", *stub(size="{micro_batch_size:4}"))
    assert code == 0 and "largest micro-batch size that fits every stage: 16" in out, out + err
    code, out, err, _ = fit("--capacity-gb", "8", "--work-dir", str(work), "--json", "--", "bash", "-c",
                            "echo 'ValueError: bad flag' >&2; exit 3; {micro_batch_size:4}")  # fmt: skip
    result = one_object(out)
    assert code == 1, out + err
    assert result["micro_batch_size"] is None and result["command"] is None
    assert "exited with 3" in result["error"] and "ValueError: bad flag" in result["error"]
    assert [probe["outcome"] for probe in result["probes"]] == ["could not measure"]
    assert not list((work / "probe-1-mbs-4").glob("rank-*"))  # the last fit's records were cleared
    assert "Traceback" not in err


@pytest.mark.processes
def test_a_probe_that_times_out_is_could_not_measure_never_over_the_limit(tmp_path):
    # Size 2 measured from its records (a launch under the 1 s timeout: a loaded machine's Python may not
    # write its record in time), so the one launch is size 16's, which hangs.
    records = recorded(tmp_path / "size-2", 2)
    limits = ["--capacity-gb", "8", "--probe-timeout-s", "1", "--grace-s", "1", "--json"]
    code, out, err, seconds = fit(*limits, "--from-records", str(records), "--", *stub("hang-above-2"), tmp=tmp_path)
    result = one_object(out)
    assert code == 1, out + err
    assert [p["outcome"] for p in result["probes"]] == ["fits", "could not measure"]
    assert result["probes"][1]["status"] == "timeout" and result["micro_batch_size"] is None
    assert "probe 1 (micro-batch size 16) could not measure" in result["error"]
    assert "largest size measured to fit so far is 2" in result["error"]
    assert "over the limit" not in err and "nothing fits" not in err
    print(f"ended at its 1 s timeout and 1 s grace: fit took {seconds:.1f} s")


@pytest.mark.processes
def test_a_probe_that_dies_of_memory_is_over_the_limit_and_fit_steps_down(tmp_path):
    code, out, err, _ = fit("--capacity-gb", "8", "--json", "--", *stub("oom-above-8"), tmp=tmp_path)
    result = one_object(out)
    assert code == 0, out + err
    assert [(p["micro_batch_size"], p["outcome"]) for p in result["probes"]] == [
        (2, "fits"), (16, "over the limit"), (8, "fits")
    ]  # fmt: skip
    assert result["micro_batch_size"] == 8 and result["error"] is None
    assert "CUDA out of memory" in result["probes"][1]["error_line"]


@pytest.mark.processes
def test_a_200000_character_line_is_read_and_shown_short(tmp_path):
    flood = "import sys; print('a' * 200000 + 'Error: wide'); print('b' * 200000); sys.exit(3)"
    code, out, err, _ = fit("--", sys.executable, "-c", flood, "{micro_batch_size}", tmp=tmp_path)
    assert code == 1, err[-2000:]
    assert max(len(line) for line in err.splitlines()) <= 400
    assert "Traceback" not in err
    code, out, _, _ = fit("--json", "--", sys.executable, "-c", flood, "{micro_batch_size}", tmp=tmp_path)
    probe = one_object(out)["probes"][0]
    assert code == 1
    assert max(len(line) for line in probe["output_tail"].splitlines()) <= 310


@pytest.mark.processes
def test_no_secret_in_fits_text_json_or_files(tmp_path):
    shout = "echo key $WANDB_API_KEY https://user:PASS456@host SECRET123 COMETKEY1"
    secret_args = ["--wandb-api-key", "SECRET123", "--comet-api-key=COMETKEY1", "https://user:PASS456@h/x"]
    env = {"WANDB_API_KEY": "KEY789", "COMET_API_KEY": "COMETKEY1"}
    work = tmp_path / "work"
    answered = ["bash", "-c", f'{shout}; {sys.executable} -c "$0" {{micro_batch_size:2}} ok', STUB, *secret_args]
    died = ["bash", "-c", f"{shout} >&2; echo 'RuntimeError: no' $WANDB_API_KEY; exit 3; {{micro_batch_size}}"]
    died += secret_args
    shown = []
    for command in (answered, died):
        for json_flag in ([], ["--json"]):
            code, out, err, _ = fit("--capacity-gb", "8", "--work-dir", str(work), *json_flag, "--", *command, env=env)
            assert code == (0 if command is answered else 1), out + err
            shown.append(out + err)
    assert "user:***@host" in shown[0] and "--wandb-api-key ***redacted***" in shown[0]
    written = [path.read_bytes().decode(errors="replace") for path in work.rglob("*") if path.is_file()]
    assert any("key ***redacted***" in text for text in written)  # probe.log: the output, scrubbed
    for text in shown + written:
        for secret in SECRETS:
            assert secret not in text


@pytest.mark.processes
def test_json_is_one_object_with_an_error_when_the_first_probe_measures_nothing(tmp_path):
    code, out, err, _ = fit("--json", "--", sys.executable, "-c", "print('COMMAND done')", "{micro_batch_size}",
                            tmp=tmp_path)  # fmt: skip
    result = one_object(out)
    assert code == 1, out + err  # from what happened (a probe measured nothing), not from the word COMMAND
    assert "measured nothing" in result["error"] and result["micro_batch_size"] is None
    kept = [path for path in tmp_path.iterdir() if path.name.startswith("nemo-memlog-fit-")]
    assert len(kept) == 1 and str(kept[0]) in result["error"]  # the path it names exists


@pytest.mark.processes
@pytest.mark.parametrize("make", ["file", "proc"])
def test_a_work_dir_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, make):
    work = tmp_path / "a-file" if make == "file" else Path("/proc/self")
    work.touch() if make == "file" else None
    code, out, err, _ = fit("--work-dir", str(work), "--", *stub())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"--work-dir {work}" in err
    code, out, err, _ = fit("--json", "--work-dir", str(work), "--", *stub())
    assert code == 2 and f"--work-dir {work}" in one_object(out)["error"]


@pytest.mark.processes
@pytest.mark.parametrize("mode, named", [("norank", "field 'rank'"), ("steps-text", "field 'measured_steps'")])
def test_a_bad_record_is_named_never_a_traceback(tmp_path, mode, named):
    work = tmp_path / "work"
    code, out, err, _ = fit("--capacity-gb", "8", "--work-dir", str(work), "--", *stub(mode))
    assert code == 1, out + err
    assert "Traceback" not in err and named in err
    assert str(work / "probe-1-mbs-2" / "rank-00000.layers.json") in err


def recorded(folder: Path, size: int, **changes) -> Path:
    """The stub's records of a run at ``size`` (a run the user has: what --from-records reads), each
    of ``changes`` then set in its record (``measured_steps=1``)."""
    folder.mkdir(parents=True)
    env = {**os.environ, "NEMO_MEMLOG_PROBE_DIR": str(folder)}
    subprocess.run([sys.executable, "-c", STUB, str(size), "ok"], env=env, check=True, timeout=60)
    path = folder / "rank-00000.layers.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


@pytest.mark.processes
def test_from_records_a_run_already_measured_is_the_first_measurement_and_no_launch(tmp_path):
    """The same search as from a first probe at 4 (16 fits at 8 GB: the reused --work-dir test), one
    launch fewer: the records are read, not launched, and shown as such."""
    records = recorded(tmp_path / "mine", 4)
    code, out, err, _ = fit("--capacity-gb", "8", "--json", "--from-records", str(records), "--", *stub(), tmp=tmp_path)
    result = one_object(out)
    assert code == 0 and result["micro_batch_size"] == 16, out + err
    first, *probes = result["probes"]
    assert (first["status"], first["micro_batch_size"], first["folder"]) == ("recorded", 4, str(records))
    assert [probe["micro_batch_size"] for probe in probes] == [16] and result["launches"] == 1
    assert f"records: micro-batch size 4: fits (peaks per stage 5.40 GB against 7.20 GB; read from {records})" in err
    code, out, err, _ = fit("--capacity-gb", "8", "--from-records", str(records), "--", *stub(), tmp=tmp_path)
    assert code == 0 and out.splitlines()[0].startswith("records: micro-batch size 4: fits") and "1 launches" in out


@pytest.mark.processes
@pytest.mark.parametrize(
    "make, named",
    [
        ("missing", "not a folder"),
        ("one step", "a rank recorded 1 measured logging steps, fewer than the 2"),
        ("no size", "do not state the run's micro-batch size"),
        ("and --start", "--start and --from-records: give one"),
    ],
)
def test_from_records_that_cannot_serve_is_one_line_exit_2_and_nothing_launched(tmp_path, make, named):
    folder = tmp_path / "records"
    if make == "one step":
        recorded(folder, 4, measured_steps=1)
    elif make == "no size":
        recorded(folder, 4, run={"microbatches": 16})
    elif make == "and --start":
        recorded(folder, 4)
    launched = tmp_path / "launched"
    command = ["bash", "-c", f"touch {launched}; {{micro_batch_size}}"]
    start = ["--start", "2"] if make == "and --start" else []
    code, out, err, _ = fit("--capacity-gb", "8", *start, "--from-records", str(folder), "--", *command, tmp=tmp_path)
    assert code == commands.USAGE_ERROR and out == "" and len(err.strip().splitlines()) == 1, err
    assert named in err and (make == "and --start" or f"--from-records {folder}: " in err)
    assert not launched.exists(), "fit launched the command before refusing its records"


@pytest.mark.processes
def test_a_size_of_a_million_without_microbatches_is_bisected(tmp_path):
    code, out, err, seconds = fit("--capacity-gb", "1000000", "--json", "--",
                                  *stub("nofacts", "{micro_batch_size:1000000}"), tmp=tmp_path)  # fmt: skip
    result = one_object(out)
    assert code == 0, out[-2000:] + err
    print(f"bisected in {seconds:.1f} s")
    assert result["candidates_count"] == 64_000_000 and len(result["candidates"]) <= 128
    assert result["launches"] <= 3 and result["micro_batch_size"] >= 1_000_000


def test_secrets_are_found_in_a_command_and_the_environment():
    command = ["bash", "-c", "COMET_API_KEY=COMETKEY1 train --wandb-api-key SECRET123 --seed 1234", "--use-token", "1"]
    command += ["--wandb-api-key", "SECRET124", "https://user:PASS456@host/x", "logger.mlflow_token=TOKEN5"]
    found = command_secrets(command)
    assert {"COMETKEY1", "SECRET123", "SECRET124", "PASS456", "TOKEN5"} <= set(found)
    assert "1234" not in found and "1" not in found  # a plain option, a switch's value
    assert environ_secrets({"WANDB_API_KEY": "KEY789", "HOME": "/root", "DEBUG": "1"}) == ["KEY789"]


@pytest.mark.parametrize(
    "command, hint",
    [
        (["torchrun", "pretrain_gpt.py", "--micro-batch-size", "4"], "--micro-batch-size {micro_batch_size:4}"),
        (["bash", "-c", "torchrun t.py --micro-batch-size=8 --lr 1"], "--micro-batch-size {micro_batch_size:8}"),
        (["python", "recipe.py", "train.micro_batch_size=2"], "'train.micro_batch_size={micro_batch_size:2}'"),
        (["python", "train.py"], "train.micro_batch_size={micro_batch_size}"),
    ],
)
def test_a_command_without_the_placeholder_is_answered_in_its_frameworks_words(command, hint):
    with pytest.raises(fit_module.FitError, match="has no {micro_batch_size}") as refused:
        fit_module.check_command(command)
    assert hint in str(refused.value) and refused.value.code == commands.USAGE_ERROR
    if "--micro-batch-size" in " ".join(command):
        assert "train.micro_batch_size" not in str(refused.value)  # no Bridge words to a Megatron-LM user


def test_probes_sharing_one_tensorboard_folder_are_told_how_to_keep_them_apart():
    megatron_lm = ["torchrun", "pretrain_gpt.py", "--micro-batch-size", "{micro_batch_size:4}", "--tensorboard-dir"]
    note = fit_words.shared_tensorboard([*megatron_lm, "/runs/tb"])
    assert note is not None and "one TensorBoard run, with repeated steps" in note
    assert "--tensorboard-dir /runs/tb/mbs-{micro_batch_size}" in note
    assert fit_words.shared_tensorboard([*megatron_lm, "/runs/tb-{micro_batch_size}"]) is None
    assert fit_words.shared_tensorboard(["python", "r.py", "train.micro_batch_size={micro_batch_size}"]) is None
    bridge = fit_words.shared_tensorboard(["python", "r.py", "logger.tensorboard_dir=/tb"])
    assert bridge is not None and "'logger.tensorboard_dir=/tb/mbs-{micro_batch_size}'" in bridge


def test_a_probes_output_is_shown_with_its_escapes_written_out(tmp_path):
    """A probe's last lines with a terminal escape and a bell: shown escaped (a carriage return
    ends a line as it is read)."""
    probe = Probe(4, tmp_path, status="died", exit_code=1, recent=b"step 1\n\x1b[2J RuntimeError: boom\x07\n")
    assert probe.error_line == "\\x1b[2J RuntimeError: boom\\x07"
    tail = probe.read_tail()
    assert tail.splitlines() == ["step 1", "\\x1b[2J RuntimeError: boom\\x07"] and "\x1b" not in tail
