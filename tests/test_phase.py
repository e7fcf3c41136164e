"""Memory phases (``nemo_memlog.memory_phase``): peaks over the phase alone, logged at the next
logging step inside its one gather, the interval's own peak kept, and a rank the kernel's OOM
killer ends inside a phase named as having died during it.

- In this process: the peaks, nesting, bad names, never raising.
- On the session's real gloo PP 4 cluster: a phase some stages ran and others did not lines up
  (the optional ``phase/`` keys), read back from TensorBoard.
- For real, in a memory cgroup (root, cgroup v1 here): two ranks under torchrun; rank 0 grows
  inside ``memory_phase("checkpoint_save")`` until the kernel kills it. This file is the rank
  script then: ``torchrun tests/test_phase.py ROOT``.
"""

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy
import pytest

MB = 2**20


def touch(megabytes: int):
    return numpy.full(megabytes * MB, 1, dtype=numpy.uint8)  # every page written: resident


def test_a_phase_has_its_own_peak_and_the_windows_peak_is_kept():
    from nemo_memlog import memory_phase
    from nemo_memlog.measure import phase
    from nemo_memlog.rank import memory

    phase.take_pending()
    memory.reset_peaks()
    before = memory.report_memory()["host_rss_gb"]
    ballast = touch(300)
    del ballast  # the window's peak is now ~300 MB above the RSS
    window_peak = memory.report_memory()["peak_host_rss_gb"]
    with memory_phase("checkpoint_save", iteration=7):
        inside = touch(100)
        del inside
    taken = phase.take_pending()
    assert set(taken) == {"phase/checkpoint_save/peak_host_rss_gb", "phase/checkpoint_save/seconds"}
    peak = taken["phase/checkpoint_save/peak_host_rss_gb"]
    assert before + 0.08 < peak < window_peak - 0.1, (before, peak, window_peak)  # its own, not the window's
    assert memory.report_memory()["peak_host_rss_gb"] >= window_peak  # reset by the phase, kept for the window
    assert phase.take_pending() == {}  # taken once
    memory.reset_peaks()  # a new window: what was kept goes
    assert memory.report_memory()["peak_host_rss_gb"] < window_peak - 0.2


def test_nested_phases_each_measure_their_span_and_a_repeat_keeps_the_largest():
    from nemo_memlog import memory_phase
    from nemo_memlog.measure import phase

    phase.take_pending()
    with memory_phase("checkpoint_save"):
        with memory_phase("eval"):
            inner = touch(200)
            del inner
        assert phase.current().name == "checkpoint_save"
    with memory_phase("eval"):
        pass  # a second, smaller run before the logging step
    taken = phase.take_pending()
    assert taken["phase/checkpoint_save/peak_host_rss_gb"] >= taken["phase/eval/peak_host_rss_gb"] > 0.15
    assert phase.current() is None


@pytest.mark.parametrize("name", ["Checkpoint", "save checkpoint", "", "x" * 41, "9lives", None, "ckpt/save"])
def test_a_name_that_is_not_a_short_identifier_is_refused_saying_what_to_use(name):
    from nemo_memlog import memory_phase

    with pytest.raises(ValueError, match="not a short identifier: use lower-case letters"):
        with memory_phase(name):
            pass


@pytest.mark.filterwarnings("error")
def test_a_failure_to_measure_warns_once_and_never_raises(monkeypatch, caplog):
    from nemo_memlog import memory_phase
    from nemo_memlog.measure import phase
    from nemo_memlog.rank import memory

    def broken():
        raise OSError("no /proc here")

    monkeypatch.setattr(memory, "fold_peaks", broken)  # cannot be provoked for real on Linux
    with caplog.at_level("WARNING", logger="nemo_memlog"):
        with memory_phase("load"):
            ran = True
    assert ran and phase.current() is None
    said = [r.getMessage() for r in caplog.records if r.name == "nemo_memlog"]
    assert [m for m in said if "could not read the peaks: no /proc here" in m] == said[:1] and len(said) == 1, said


# ---- across stages ---------------------------------------------------------------------------


def phases_on_some_stages(tensorboard_dir):
    """Every rank, three logging steps: stage 0 saves before step 2, stage 3 evaluates before step 3."""
    from megatron.core import parallel_state as ps

    from nemo_memlog import LoggerConfig, close_writers, memory_phase, training_log
    from nemo_memlog.measure import phase

    phase.take_pending()
    stage = ps.get_pipeline_model_parallel_rank()
    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_dir=tensorboard_dir, memory_record_dir="off")
    logged = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for iteration in (1, 2, 3):
            if iteration == 2 and stage == 0:
                with memory_phase("checkpoint_save"):
                    ballast = touch(150)
                    del ballast
            if iteration == 3 and stage == 3:
                with memory_phase("eval"):
                    pass
            logged.append(training_log(iteration, cfg))
        close_writers()
    return logged


@pytest.mark.processes
def test_a_phase_some_stages_ran_is_logged_with_its_stage_and_lines_up(pp4, tmp_path):
    results = pp4.run_ok(phases_on_some_stages, str(tmp_path / "tb"))
    first, second, third = results[0]
    assert all(steps == results[0] for steps in results), "every rank returns the same dicts"
    save = "memory/phase/checkpoint_save/peak_host_rss_gb"
    assert not any(key.startswith("memory/phase/") for key in first)
    assert second[save] > 0.15 and second["memory/peak_stage/phase/checkpoint_save/peak_host_rss_gb"] == 0
    assert second["memory/phase/checkpoint_save/seconds"] > 0
    assert save not in third  # no stage saved in that interval: nothing logged for it
    assert third["memory/peak_stage/phase/eval/peak_host_rss_gb"] == 3

    from nemo_memlog.offline.events import load_run

    run = load_run(tmp_path / "tb")
    written = run.get("phase/checkpoint_save/peak_host_rss_gb")
    assert written.steps == (2,) and written.values == pytest.approx([second[save]])


# ---- for real: the kernel's OOM killer inside a phase ---------------------------------------

LIMIT = 1_600_000_000
SAVE_AT = 3


def rank_main(root: str) -> int:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_memlog import LoggerConfig, memory_phase, training_log
    from nemo_memlog.testing.wait import wait_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=f"{root}/memory_records")
    held = []
    for iteration in range(1, 20):
        training_log(iteration, cfg)
        if iteration == SAVE_AT and dist.get_rank() == 0:
            with memory_phase("checkpoint_save"):
                wait_for(lambda: beat_in_phase(root, "checkpoint_save"), 60, "a liveness beat inside the phase")
                while True:  # staging a checkpoint that does not fit: the OOM killer ends it
                    held.append(touch(64))
        time.sleep(0.1)
    return 0


def beat_in_phase(root: str, name: str) -> bool:
    """Whether this rank's last liveness beat, in its flight record under ``root``, names phase ``name``."""
    import torch.distributed as dist

    from nemo_memlog.failure import records

    for path in Path(root, "memory_records").rglob(records.file_name(dist.get_rank())):
        with open(path, "rb") as record:
            record.seek(records.HEADER_BYTES)
            slot = record.read(records.LIVENESS_BYTES)
        try:
            beat = records.decode(slot)
        except records.RecordError:  # caught mid-write: the next poll reads it whole
            continue
        if beat and beat.get("phase") == name:
            return True
    return False


@pytest.mark.processes
def test_a_rank_killed_inside_a_phase_died_during_it_at_the_cgroup_limit(tmp_path):
    from nemo_memlog.testing import cgroups
    from nemo_memlog.testing.torchrun import run, tail, torchrun_env

    ok, why = cgroups.available()
    if not ok:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    with cgroups.memory_cgroup(LIMIT) as group:
        done = run(__file__, tmp_path, nproc=2, monitor_interval=1, cgroup=group)
        kills = group.oom_kills()
    assert done.returncode != 0 and kills >= 1, (kills, tail(done, 2000))
    pm = subprocess.run(
        [sys.executable, "-m", "nemo_memlog.cli", "postmortem", "--json", str(tmp_path / "memory_records")],
        capture_output=True,
        text=True,
        timeout=120,
        env=torchrun_env(),
    )
    assert pm.returncode == 1, pm.stderr
    found = json.loads(pm.stdout)
    first = found["first_failure"]
    sentence = first["sentence"]
    print(sentence)
    assert (first["rank"], first["status"], first["ambiguous_with"]) == (0, "unfinished", []), sentence
    assert first["phase"]["name"] == "checkpoint_save" and first["phase"]["iteration"] == SAVE_AT
    assert f", during checkpoint_save, which began at iteration {SAVE_AT}, " in sentence
    assert f"of its {LIMIT / 1e9:.2f} GB limit" in sentence, sentence
    assert first["probable_host_oom_kill"], sentence
    assert found["died_of_first_failure"] == [1]


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[1:]))
