"""``nemo-memlog fit`` says what it does as it goes, on stderr (a probe starting, how far it is, its
verdict as soon as it ends), so ``--json`` stays one object on stdout; interrupted, it says what was
measured so far and exits 130 (JSON: the object with the probes measured). Stub probes
(nemo_memlog.testing.probe_stub): a record in well under a second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from nemo_memlog.testing.probe_stub import STUB
from nemo_memlog.testing.torchrun import ROOT
from nemo_memlog.testing.wait import Lines, as_at_a_terminal, wait_for

pytestmark = pytest.mark.processes
FIT = [sys.executable, "-m", "nemo_memlog.cli", "fit", "--capacity-gb", "8", "--json"]


def _start(tmp_path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    command = [*FIT, "--", sys.executable, "-c", STUB, "{micro_batch_size:2}", mode]
    return subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_at_a_terminal,
    )


def test_each_probe_is_said_as_it_starts_and_as_it_ends_and_json_stays_one_object(tmp_path):
    fit = _start(tmp_path, "ok")
    out, err = fit.communicate(timeout=120)
    assert fit.returncode == 0, err
    answer = json.loads(out)  # stdout: the one object
    lines = [line for line in err.splitlines() if line.startswith("nemo-memlog fit: probe ")]
    assert len(lines) == 2 * answer["launches"], err  # each probe: started, then its verdict
    assert "probe 1: micro-batch size 2: starting " in lines[0] and "{micro_batch_size" not in lines[0]
    verdict = "nemo-memlog fit: probe 1: micro-batch size 2: fits (peaks per stage 5.20 GB against 7.20 GB; "
    assert lines[1].startswith(verdict)
    assert "probe 2: micro-batch size " in lines[2] and "predicted peaks per stage" in lines[2]


def test_interrupted_it_says_what_was_measured_and_json_holds_it(tmp_path):
    fit = _start(tmp_path, "hang-above-2")  # probe 1 (size 2) measures; probe 2 never records
    out, said = Lines(fit.stdout), Lines(fit.stderr)  # read by threads: every wait below has a deadline
    try:
        wait_for(lambda: "probe 2: running" in said.text(), 90, "the progress line of probe 2 (every 10 s)",
                 proc=fit, detail=said.text)  # fmt: skip
        fit.send_signal(signal.SIGINT)
        fit.wait(timeout=60)
        out_text, err = out.ended(30), said.ended(30)
    finally:
        if fit.poll() is None:
            fit.kill()
            fit.wait(timeout=30)
    assert fit.returncode == 130, err
    result = json.loads(out_text)
    assert result["interrupted"] == "SIGINT"
    assert [probe["outcome"] for probe in result["probes"]] == ["fits"]  # what was measured before the signal
    assert "the largest size measured to fit so far is 2" in result["error"]
    assert "ranks whose peak is steady: none yet" in err
    assert "the largest size measured to fit so far is 2" in err


def test_a_command_that_keeps_its_microbatches_is_refused_at_the_second_probes_first_record(tmp_path):
    fit = _start(tmp_path, "keeps-microbatches")  # probe 2 records one step, then would run 600 s
    try:
        # A fit that waited for probe 2's further measured steps, or for its end, would wait out the
        # stub's 600 s: it would still run at this deadline (TimeoutExpired), whatever the machine's load.
        out, err = fit.communicate(timeout=120)
    finally:
        if fit.poll() is None:
            fit.kill()
            fit.communicate(timeout=30)
    assert fit.returncode == 1, err
    result = json.loads(out)
    assert "keeps its microbatches per iteration, not its global batch" in result["error"]
