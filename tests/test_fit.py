"""``nemo-memlog fit`` against the truth, with real processes: a real-Megatron job (megatron-core's
GPTModel, DDP, Adam and 1F1B schedule under torchrun, nemo_memlog.testing.megatron_job) and the demo,
each swept by brute force in the test (one launch per size, run to its end, the peaks read from the
records' ``peak_host_rss_gb``); a real OOM under a memory cgroup; Ctrl-C during a probe; the
refusal when nothing fits. Every test checks that no process of its probes is left."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_memlog.measure import layer_record
from nemo_memlog.testing import cgroups
from nemo_memlog.testing.torchrun import ROOT
from nemo_memlog.testing.wait import left_behind

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: PP 2, 4 layers, hidden 256, seq 256, 16 samples per iteration: sizes 1, 2, 4, 8, 16 (swept: 4 to 16).
JOB = ["-m", "nemo_memlog.testing.megatron_job", "--global-batch", "16", "--hidden", "256", "--seq", "256"]
SWEPT = (4, 8, 16)
FIT = [sys.executable, "-m", "nemo_memlog.offline.cli", "fit", "--json"]


def job(out: Path, size="{micro_batch_size}", *extra: str) -> list[str]:
    return [*TORCHRUN, *JOB, "--micro-batch-size", str(size), "--out", str(out), *extra]


def stage_peaks(folder: Path) -> list[float]:
    """Per pipeline stage, the highest peak_host_rss_gb its ranks recorded: read apart from advice/."""
    peaks: dict[int, float] = {}
    for record in layer_record.read_folder(folder):
        stage = int(record["pp_rank"])
        peaks[stage] = max(peaks.get(stage, 0.0), record["stage"]["peak_host_rss_gb"])
    return [peaks[stage] for stage in sorted(peaks)]


def fit(*args: str, timeout: float = 600) -> tuple[int, dict, str]:
    done = subprocess.run([*FIT, *args], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    try:
        out = json.loads(done.stdout)
    except json.JSONDecodeError:
        out = {}
    return done.returncode, out, done.stdout + done.stderr


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """{size: per-stage peak (GB)} of the Megatron job run to its end (3 iterations) at each size, and
    {size: the whole job's peak (torchrun and its ranks, GB)} where a memory cgroup can measure it."""
    root = tmp_path_factory.mktemp("sweep")
    peaks, jobs = {}, {}
    measurable, _ = cgroups.available()
    for size in SWEPT:
        out = root / f"mbs-{size}"
        with cgroups.memory_cgroup(1 << 40) if measurable else contextlib.nullcontext() as group:
            command = [*joining(group), *job(out, size, "--iters", "3")]
            done = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, timeout=300)
            if group is not None:
                jobs[size] = int((group.path / "memory.max_usage_in_bytes").read_text()) / 1e9
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[size] = stage_peaks(out / "memory_records")
    assert all(max(peaks[a]) < max(peaks[b]) for a, b in zip(SWEPT, SWEPT[1:])), peaks  # grows with the size
    return peaks, jobs


def joining(group) -> list[str]:
    """A command prefix that moves the command into ``group`` (a memory cgroup) before it runs."""
    if group is None:
        return []
    return ["sh", "-c", f'echo $$ > {group.path}/cgroup.procs && exec "$@"', "sh"]


def truth(peaks: dict, limit: float) -> int | None:
    fitting = [size for size, stages in peaks.items() if max(stages) <= limit]
    return max(fitting) if fitting else None


@pytest.mark.processes
@pytest.mark.slow
def test_fit_finds_the_largest_size_that_fits_megatrons_job_within_three_launches(sweep, tmp_path):
    peaks, _ = sweep
    capacity = (max(peaks[4]) + max(peaks[8])) / 2  # between two candidates' measured peaks
    expected = truth(peaks, capacity)
    assert expected == 4
    code, out, text = fit(
        "--capacity-gb", f"{capacity:.4f}", "--margin", "0", "--", *job(tmp_path, "{micro_batch_size:2}")
    )  # fmt: skip
    assert code == 0, text
    assert out["micro_batch_size"] == expected, text
    assert out["launches"] <= 3 and out["probes"][0]["micro_batch_size"] == 2  # the placeholder's start
    assert [row["stage"] for row in out["stages"]] == [0, 1]
    for row, swept in zip(out["stages"], peaks[expected]):
        assert row["capacity_gb"] == pytest.approx(capacity, rel=1e-3)
        assert row["measured_peak_gb"] <= capacity
        assert row["measured_peak_gb"] == pytest.approx(swept, rel=0.05)  # the confirmation against the sweep
        assert row["predicted_peak_gb"] == pytest.approx(row["measured_peak_gb"], rel=0.10)
    assert "--micro-batch-size 4" in out["command"]
    assert not left_behind(str(tmp_path))
    print("fit:", out["launches"], "launches,", out["seconds"], "s;", [p["seconds"] for p in out["probes"]], text)


def demo(root: Path, size="{micro_batch_size}") -> list[str]:
    """The demo on 2 processes (PP 2), 64 samples per iteration (sizes 1 to 64), TensorBoard only
    (the other backends' start-up is half a launch here, and plays no part in the memory of a stage)."""
    keys = ["parallel.pp=2", "train.global_batch_size=64", f"train.micro_batch_size={size}", f"run.root={root}"]
    keys += ["logger.wandb_project=null", "logger.mlflow_experiment=null", "logger.comet_project=null"]
    return [*TORCHRUN, "scripts/demo.py", *keys, "train.iters=3", "train.save_every=0"]


@pytest.mark.processes
@pytest.mark.slow
def test_fit_finds_the_largest_size_that_fits_the_demo(tmp_path):
    """The demo swept at the two sizes around the capacity (the sizes below fit, above do not:
    a stage's peak grows with the size), then fit from a smaller start."""
    peaks = {}
    for size in (16, 32):
        root = tmp_path / f"sweep-{size}"
        done = subprocess.run(demo(root, size), env=ENV, cwd=ROOT, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[size] = stage_peaks(next(root.glob("demo-*")) / "memory_records")
    assert max(peaks[32]) > max(peaks[16]) * 1.05, peaks
    capacity = (max(peaks[16]) + max(peaks[32])) / 2
    code, out, text = fit("--capacity-gb", f"{capacity:.4f}", "--margin", "0", "--start", "8", "--", *demo(tmp_path))
    assert code == 0, text
    assert out["micro_batch_size"] == truth(peaks, capacity) == 16, text
    assert out["launches"] <= 3
    for row, swept in zip(out["stages"], peaks[16]):
        assert row["measured_peak_gb"] == pytest.approx(swept, rel=0.05)
    assert not left_behind(str(tmp_path))


@pytest.mark.processes
@pytest.mark.slow
def test_fit_steps_down_when_the_kernel_kills_the_confirming_probe(sweep, tmp_path):
    """The job's memory cgroup ends the larger size for real; fit was told more capacity than the
    cgroup gives, so it predicts that size fits, launches it, sees it die, and steps down."""
    peaks, jobs = sweep
    if not jobs:
        pytest.skip(cgroups.available()[1])
    limit = int((jobs[4] + jobs[8]) / 2 * 1e9)  # the whole job at size 4 runs under it, at 8 it is killed
    with cgroups.memory_cgroup(limit) as group:
        capacity = max(peaks[8]) * 1.12  # what fit is told: size 8 predicted to fit, 16 not
        code, out, text = fit(
            "--capacity-gb", f"{capacity:.4f}", "--margin", "0", "--start", "2", "--grace-s", "5",
            "--", *joining(group), *job(tmp_path / "fit"),
        )  # fmt: skip
        kills = group.oom_kills()
        remaining = group.pids()
    assert code == 0, text
    statuses = {probe["micro_batch_size"]: probe["status"] for probe in out["probes"]}
    assert kills >= 1 and "died" in statuses.values(), text
    died = min(size for size, status in statuses.items() if status == "died")
    assert out["micro_batch_size"] is not None and out["micro_batch_size"] < died
    assert statuses[out["micro_batch_size"]] == "measured"
    assert out["launches"] <= 3
    assert remaining == [] and not left_behind(str(tmp_path))
    print("fit under the cgroup:", statuses, out["seconds"], "s")


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_fit_interrupted_during_a_probe_leaves_nothing_running(tmp_path, signum, code):
    """Ctrl-C and SIGTERM: fit has the probe's guard end its processes, and waits. SIGKILL: the guard
    finds fit's end of its pipe closed and ends them (tests/test_fit_guard.py: every other kind)."""
    marker = str(tmp_path)
    # --interval 100000: the probe never records, so fit is waiting on it when the signal comes
    proc = subprocess.Popen(
        [*FIT, "--capacity-gb", "4", "--start", "2", "--work-dir", str(tmp_path / "work"), "--",
         *job(tmp_path, "{micro_batch_size}", "--interval", "100000")],
        env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        log = tmp_path / "work" / "probe-1-mbs-2" / "probe.log"
        deadline = time.monotonic() + 240
        while not (log.exists() and "iteration 1 " in log.read_text(errors="replace")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        assert len(left_behind(marker)) >= 3  # torchrun and its two ranks, training
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, stderr
    if signum != signal.SIGKILL:
        assert "interrupted" in stderr
        assert not left_behind(marker)
    else:  # ended by the guard, once fit's end of its pipe closed
        deadline = time.monotonic() + 90
        while left_behind(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left_behind(marker)


@pytest.mark.processes
@pytest.mark.slow
def test_nothing_fits_exits_2_and_names_what_would(tmp_path):
    """Long sequences: the activations are most of the peak, so recompute would fit where no size does."""
    long = ["--hidden", "128", "--heads", "8", "--seq", "1024", "--layers", "2", "--global-batch", "2"]
    measure = tmp_path / "measure"
    code, first, text = fit(
        "--capacity-gb",
        "100",
        "--max-launches",
        "1",
        "--work-dir",
        str(measure),
        "--",
        *job(tmp_path, "{micro_batch_size}", *long),
    )
    assert code == 0 and first["micro_batch_size"] == 1, text
    records = next(measure.glob("probe-1-*"))
    advised = subprocess.run(
        [sys.executable, "-m", "nemo_memlog.offline.cli", "advise", str(records), "--what-if", "recompute=full",
         "--json", "--no-png"], env=ENV, cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    predicted = max(stage["peak_gb"] for stage in json.loads(advised.stdout)["stages"])
    measured = max(first["probes"][0]["measured_peaks_gb"])
    assert measured - predicted > 0.06, (measured, predicted)  # recompute keeps far less (about 0.1 GB)
    capacity = (measured + predicted) / 2
    code, out, text = fit(
        "--capacity-gb", f"{capacity:.4f}", "--margin", "0", "--", *job(tmp_path, "{micro_batch_size}", *long)
    )
    assert code == 2, text
    assert out["micro_batch_size"] is None and out["launches"] == 1
    assert any("recompute=full" in alternative["changes"] for alternative in out["alternatives"]), text
    assert not left_behind(str(tmp_path))


@pytest.mark.processes
@pytest.mark.slow
def test_a_command_that_keeps_its_microbatches_not_its_global_batch_is_named(tmp_path):
    """The demo without train.global_batch_size keeps 4 microbatches whatever the size: the second
    probe's global batch differs from the first's, and fit says what to give the command."""
    command = [arg for arg in demo(tmp_path, "{micro_batch_size:8}") if not arg.startswith("train.global_batch")]
    code, _, text = fit("--capacity-gb", "50", "--max-launches", "2", "--", *command)
    assert code == 1, text
    assert "keeps its microbatches per iteration, not its global batch" in text and "global_batch_size" in text
    assert not left_behind(str(tmp_path))


@pytest.mark.processes
def test_fit_refuses_a_command_without_the_placeholder(tmp_path):
    code, _, text = fit("--", sys.executable, "-c", "pass")
    assert code == 2 and "{micro_batch_size}" in text


def test_candidates_keep_the_global_batch_and_the_interleaved_schedules_group():
    from nemo_memlog import advice
    from nemo_memlog.offline.fit import _candidates

    stages = [advice.Stage(s, {"params_gb": 0.1}, 2 - s, chunks=2) for s in range(2)]
    run = advice.Run.of(stages, {"pp_size": 2}, {"micro_batch_size": 4, "microbatches": 4}, gpu=False, capacity_gb=1)
    assert _candidates(run) == [1, 2, 4, 8]  # 16 samples; one microbatch of 16 is below the group of PP 2
    one_chunk = advice.Run.of(
        [dataclasses.replace(stage, chunks=1) for stage in stages],
        {"pp_size": 2}, {"micro_batch_size": 4, "microbatches": 4}, gpu=False, capacity_gb=1,
    )  # fmt: skip
    assert _candidates(one_chunk) == [1, 2, 4, 8, 16]


def test_a_died_probes_tail_leads_with_its_error(tmp_path):
    from nemo_memlog.offline.probe import LOG_NAME, Probe

    (tmp_path / LOG_NAME).write_text("start\n[rank0]: ValueError: no\n" + "\n".join(f"summary {i}" for i in range(20)))
    tail = Probe(1, tmp_path).read_tail(5).splitlines()
    assert tail[0] == "[rank0]: ValueError: no" and tail[1:] == [f"summary {i}" for i in range(15, 20)]
