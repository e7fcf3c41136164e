"""``nemo-memlog fit``'s search against the truth, once, on a real job: megatron-core's GPTModel, DDP,
Adam and 1F1B schedule under torchrun (nemo_memlog.testing.megatron.job), swept by brute force in the
test (one launch per size, run to its end, the peaks read from the records' ``peak_host_rss_gb`` and
the job's memory cgroup's own peak charge); a real OOM under a memory cgroup; a cgroup limit judged
as the kernel charges it; the refusal when nothing fits. Every test checks that no process of its
probes is left. What holds the rest: tests/test_fit_guard.py (signals on a stub process tree of
setsid daemons and double forks, and one real torchrun SIGKILLed), tests/test_fit_talks.py (progress,
Ctrl-C's summary, the keeps-microbatches refusal), tests/test_fit_hostile.py (bad input)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_memlog.launch import fit as fit_module
from nemo_memlog.offline import advise
from nemo_memlog.testing import cgroups
from nemo_memlog.testing.megatron import cpu as megatron_cpu
from nemo_memlog.testing.torchrun import ROOT
from nemo_memlog.testing.wait import left_behind

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: PP 2, 4 layers, hidden 256, seq 256, 16 samples per iteration: sizes 1, 2, 4, 8, 16 (swept: 4 and 8).
JOB = ["-m", "nemo_memlog.testing.megatron.job", "--global-batch", "16", "--hidden", "256", "--seq", "256"]
SWEPT = (4, 8)
#: Iterations each swept size runs to its end: longer than a probe waits for its peak to be steady
#: (at least 3 measured steps), what the probe's peak is held against (within 2%).
SWEPT_ITERS = 8
#: How far two runs of one size apart differ in a stage's host peak on this machine (the probe against
#: the sweep; stage 1's peak creeps up to 5% after its third step): what a rerun is held to, never less.
RERUN_NOISE = 0.05
FIT = [sys.executable, "-m", "nemo_memlog.cli", "fit", "--json"]


def job(out: Path, size="{micro_batch_size}", *extra: str) -> list[str]:
    return [*TORCHRUN, *JOB, "--micro-batch-size", str(size), "--out", str(out), *extra]


def stage_peaks(folder: Path) -> list[float]:
    """Per pipeline stage, first to last, the highest peak_host_rss_gb its ranks recorded."""
    peaks = megatron_cpu.recorded_stage_peaks(folder)
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
    """{size: per-stage peak (GB)} of the Megatron job run to its end (SWEPT_ITERS) at each size,
    {size: the whole job's peak (torchrun and its ranks, GB)} where a memory cgroup can measure it,
    and the folder of the runs (``mbs-S/memory_records``: each size's records).

    A cgroup is charged the page cache of the files its processes read first: the job's libraries
    read from disk made a run's peak charge 0.57 GB higher than the same run's with them cached
    (0.90 against 0.33 GB for the imports alone), and size 4's (run first) read 1.58 GB against size
    8's 1.45. So the job runs once, one iteration, outside any cgroup before the sweep: every run
    here and every probe of fit's then finds them cached (charged elsewhere), as a second run does."""
    root = tmp_path_factory.mktemp("sweep")
    peaks, jobs = {}, {}
    measurable, _ = cgroups.available()
    if measurable:  # the files the job reads, in the page cache first (charged outside the runs' cgroups)
        warm = subprocess.run(
            job(root / "warm", 1, "--iters", "1"), env=ENV, cwd=ROOT, capture_output=True, timeout=300
        )
        assert warm.returncode == 0, warm.stderr[-3000:]
    for size in SWEPT:
        out = root / f"mbs-{size}"
        with cgroups.memory_cgroup(1 << 40) if measurable else contextlib.nullcontext() as group:
            command = [*joining(group), *job(out, size, "--iters", str(SWEPT_ITERS))]
            done = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, timeout=300)
            if group is not None:
                jobs[size] = int((group.path / "memory.max_usage_in_bytes").read_text()) / 1e9
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[size] = stage_peaks(out / "memory_records")
    assert all(max(peaks[a]) < max(peaks[b]) for a, b in zip(SWEPT, SWEPT[1:])), peaks  # grows with the size
    return peaks, jobs, root


def joining(group) -> list[str]:
    """A command prefix that moves the command into ``group`` (a memory cgroup) before it runs."""
    if group is None:
        return []
    return ["sh", "-c", f'echo $$ > {group.path}/cgroup.procs && exec "$@"', "sh"]


@pytest.mark.processes
@pytest.mark.slow
def test_fit_steps_down_when_the_kernel_kills_the_confirming_probe(sweep, tmp_path):
    """The job's memory cgroup ends the larger size for real; fit was told more capacity than the
    cgroup gives, so from size 4 (the sweep's run, given with --from-records: read, not launched) it
    predicts that 8 fits, launches it, sees it die, and answers the size measured (1 launch)."""
    peaks, jobs, root = sweep
    if not jobs:
        pytest.skip(cgroups.available()[1])
    limit = int((jobs[4] + jobs[8]) / 2 * 1e9)  # the whole job at size 4 runs under it, at 8 it is killed
    with cgroups.memory_cgroup(limit) as group:
        capacity = max(peaks[8]) * 1.12  # what fit is told: size 8 predicted to fit, 16 not
        code, out, text = fit(
            "--capacity-gb", f"{capacity:.4f}", "--margin", "0", "--grace-s", "5",
            "--from-records", str(root / "mbs-4" / "memory_records"), "--", *joining(group), *job(tmp_path / "fit"),
        )  # fmt: skip
        kills = group.oom_kills()
        remaining = group.pids()
    assert code == 0, text
    statuses = {probe["micro_batch_size"]: probe["status"] for probe in out["probes"]}
    assert kills >= 1 and "died" in statuses.values(), text
    died = min(size for size, status in statuses.items() if status == "died")
    assert out["micro_batch_size"] is not None and out["micro_batch_size"] < died
    assert statuses == {4: "recorded", 8: "died"} and out["launches"] == 1, statuses
    # The records read as the sweep read them (its ranks' peak_host_rss_gb): the probe's steady peak
    # against the sweep is the cgroup test's (below).
    assert out["probes"][0]["measured_peaks_gb"] == pytest.approx(peaks[4], rel=1e-6), out["probes"][0]
    assert remaining == [] and not left_behind(str(tmp_path))
    print("fit under the cgroup:", statuses, out["seconds"], "s")


@pytest.mark.processes
@pytest.mark.slow
def test_fit_under_a_real_cgroup_answers_the_larger_size_that_runs_and_report_shows_no_negative_headroom(
    sweep, tmp_path
):
    """No --capacity-gb: the job's memory cgroup is the limit, judged as the kernel charges it (shared
    pages once: offline/node_charge.py), not each rank's RSS against an even share of it. The limit
    lies between the cgroup's own peak charges at sizes 4 and 8 (the sweep's): fit answers 4, the
    largest size that runs, within three launches from the placeholder's 2, its confirmed peaks the
    sweep's and its prediction of them within 10%; and ``report`` of that size under the limit
    (``--records``: fit's probe folder) shows no negative headroom. (fit's search, proven once on a
    real job: here.)"""
    peaks, jobs, _ = sweep
    if not jobs or not Path("/sys/fs/cgroup/memory").is_dir():
        pytest.skip("needs a writable cgroup v1 memory controller (memory.max_usage_in_bytes)")
    even_share = 2 * max(peaks[4])  # the limit at which stage 0's RSS is half of it: the old judgment's edge
    assert jobs[4] < min(jobs[8], even_share), (jobs, peaks[4])
    limit = int((jobs[4] + min(jobs[8], even_share)) / 2 * 1e9)  # size 4 runs under it, 8 does not
    with cgroups.memory_cgroup(limit) as group:
        code, out, text = fit(
            "--margin", "0", "--work-dir", str(tmp_path / "work"),
            "--", *joining(group), *job(tmp_path / "fit", "{micro_batch_size:2}"),
        )  # fmt: skip
    assert code == 0, text
    assert out["micro_batch_size"] == 4, text
    statuses = {probe["micro_batch_size"]: probe["status"] for probe in out["probes"]}
    assert statuses[4] == "measured" and "judged per node" in out["capacity_source"]
    assert out["launches"] <= 3 and out["probes"][0]["micro_batch_size"] == 2  # the placeholder's start
    assert [row["stage"] for row in out["stages"]] == [0, 1] and "--micro-batch-size 4" in out["command"]
    for row, swept in zip(out["stages"], peaks[4]):
        assert row["measured_peak_gb"] == pytest.approx(swept, rel=RERUN_NOISE)  # the confirmation against the sweep
        assert row["predicted_peak_gb"] == pytest.approx(row["measured_peak_gb"], rel=0.10)  # from size 2
    four = next((tmp_path / "work").glob("probe-*-mbs-4"))
    measured = advise.load(four)
    assert fit_module.measured_fits(measured, 0.0) and measured.nodes[0].charge_gb <= limit / 1e9
    assert not fit_module.measured_fits(dataclasses.replace(measured, nodes=()), 0.0)  # RSS against half: "no"
    assert not left_behind(str(tmp_path))
    # Size 4 to its end fits under the limit by the sweep's own measure (its whole run's peak charge,
    # 3 iterations, below the limit); the report of fit's size-4 probe (the job's TensorBoard events,
    # its records kept in fit's probe folder) shows no negative headroom.
    assert jobs[4] * 1e9 < limit
    reported = subprocess.run(
        [sys.executable, "-m", "nemo_memlog.cli", "report", str(tmp_path / "fit"), "--records", str(four),
         "--png", str(tmp_path / "r.png")], env=ENV, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert reported.returncode == 0, reported.stderr
    headroom = next(line for line in reported.stdout.splitlines() if line.startswith("least headroom"))
    assert "-" not in headroom.split(":", 1)[1].split()[0], reported.stdout
    print("limit", limit, "charges", jobs, "fit", statuses, "report:", headroom)


@pytest.mark.processes
@pytest.mark.slow
def test_the_probes_steady_rule_reads_each_stages_peak_within_5_percent_of_the_run_at_8_steps(sweep):
    """The probe's stop rule (probe.steady) on the sweep's own runs, step by step as their TensorBoard
    events logged each stage's peak: where it would have ended the probe, each stage's peak within 5%
    of the same run's at its end (SWEPT_ITERS steps), no rerun's noise between them."""
    from nemo_memlog.launch.fit import probe
    from tests.readback import tensorboard_runs

    _, _, root = sweep
    for size in SWEPT:
        logged = tensorboard_runs(root / f"mbs-{size}")
        for stage in (0, 1):
            series = [value for _, value in next(iter(logged.values()))[f"memory/pp_stage_{stage}/peak_host_rss_gb"]]
            assert len(series) == SWEPT_ITERS, series
            ended = next(step for step in range(1, len(series) + 1) if probe.steady(dict(enumerate(series[:step], 1))))
            print(f"size {size} stage {stage}: steady at step {ended} of {series}")
            # 5%, not the 2%: a fresh clone's run read 0.8748 where the rule stopped, 0.8999 at
            # step 8 (-2.8%): the host's peak can still jump after three steps within 1% (issue 55).
            assert ended >= 4 and series[ended - 1] == pytest.approx(series[-1], rel=0.05), (size, stage, series)


@pytest.mark.processes
@pytest.mark.slow
def test_advise_predicts_the_peak_stages_change_from_4_to_8_and_its_range_holds_the_rerun(sweep):
    """advise from size 4's records, micro_batch_size=x2, against the sweep's size 8 run (the records'
    peak_host_rss_gb, read apart from advice/). Held on stage 0, the first, where the pipeline's peak lives
    (the most microbatches in flight): its predicted change within 50% of the change measured
    (-9% to -16% in five sweeps; the temporaries in proportion, before: +52%), and its range, at most
    1.25x wide, holding the rerun's peak within a rerun's noise. Stage 1 (one microbatch in flight,
    activations a small share) is printed, not held: its measured change moved from +0.109 to
    +0.168 GB between sweeps of the same sizes on a loaded 2-core machine (predicted +0.077: -29% to
    -54%), more than a bound could tell from the rule's own error. Where activations dominate (hidden
    64, seq 256, micro-batch 64) both stages came within 20% (docs/advise.md, -18% to +17%)."""
    from nemo_memlog import advice

    peaks, _, root = sweep
    run = advise.load(root / "mbs-4" / "memory_records")
    outcomes = advice.predict(run, advice.parse(["micro_batch_size=x2"]))
    for outcome in outcomes:
        before, after = peaks[4][outcome.stage], peaks[8][outcome.stage]
        assert outcome.peak_now_gb == pytest.approx(before, rel=1e-6)
        assert outcome.peak_high_gb <= advice.MAX_RANGE * outcome.peak_low_gb * (1 + 1e-9)
        predicted, measured = outcome.peak_gb - before, after - before
        print(f"stage {outcome.stage}: change measured {measured:+.4f} GB, predicted {predicted:+.4f} GB")
    (first,) = [outcome for outcome in outcomes if outcome.stage == 0]
    before, after = peaks[4][0], peaks[8][0]
    assert first.peak_gb - before == pytest.approx(after - before, rel=0.50), (first.peak_gb - before, after - before)
    # Within a rerun's noise: CI's stage 1 read 0.8219 GB against a range's top of 0.8051 (+2.1%).
    low, high = first.peak_low_gb * (1 - RERUN_NOISE), first.peak_high_gb * (1 + RERUN_NOISE)
    assert low <= after <= high, (first.peak_range_gb, after)


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
        [sys.executable, "-m", "nemo_memlog.cli", "advise", str(records), "--what-if", "recompute=full",
         "--json", "--no-png"], env=ENV, cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    predicted = max(stage["peak_gb"] for stage in json.loads(advised.stdout)["stages"])
    measured = max(first["probes"][0]["measured_peaks_gb"])
    assert measured - predicted > 0.06, (measured, predicted)  # recompute keeps far less (about 0.1 GB)
    capacity = (measured + predicted) / 2
    code, out, text = fit(
        "--capacity-gb", f"{capacity:.4f}", "--margin", "0", "--from-records", str(records),
        "--", *job(tmp_path, "{micro_batch_size}", *long),
    )  # fmt: skip
    assert code == 2, text  # size 1, the smallest, measured over the limit (the records): nothing left to launch
    assert out["micro_batch_size"] is None and out["launches"] == 0 and out["probes"][0]["status"] == "recorded"
    assert any("recompute=full" in alternative["changes"] for alternative in out["alternatives"]), text
    assert not left_behind(str(tmp_path))


@pytest.mark.processes
def test_fit_refuses_a_command_without_the_placeholder(tmp_path):
    code, _, text = fit("--", sys.executable, "-c", "pass")
    assert code == 2 and "{micro_batch_size}" in text


def test_candidates_keep_the_global_batch_and_the_interleaved_schedules_group():
    from nemo_memlog import advice
    from nemo_memlog.launch.fit import _candidates

    stages = [advice.Stage(s, {"params_gb": 0.1}, 2 - s, chunks=2) for s in range(2)]
    run = advice.Profile.of(
        stages, {"pp_size": 2}, {"micro_batch_size": 4, "microbatches": 4}, gpu=False, capacity_gb=1
    )
    assert _candidates(run) == [1, 2, 4, 8]  # 16 samples; one microbatch of 16 is below the group of PP 2
    one_chunk = advice.Profile.of(
        [dataclasses.replace(stage, chunks=1) for stage in stages],
        {"pp_size": 2}, {"micro_batch_size": 4, "microbatches": 4}, gpu=False, capacity_gb=1,
    )  # fmt: skip
    assert _candidates(one_chunk) == [1, 2, 4, 8, 16]


def test_a_died_probes_tail_leads_with_its_error(tmp_path):
    from nemo_memlog.launch.fit.probe import LOG_NAME, Probe

    (tmp_path / LOG_NAME).write_text("start\n[rank0]: ValueError: no\n" + "\n".join(f"summary {i}" for i in range(20)))
    tail = Probe(1, tmp_path).read_tail(5).splitlines()
    assert tail[0] == "[rank0]: ValueError: no" and tail[1:] == [f"summary {i}" for i in range(15, 20)]
