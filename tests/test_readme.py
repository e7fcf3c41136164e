"""README.md's usage snippets, run as written: each block marked ``<!-- test_readme: NAME -->``
is pasted into a file NAME in an empty folder, and the ``command`` block after it is run
there under torchrun (2 gloo processes on CPU), with this environment's bin on PATH (as after
``source .venv/bin/activate``). What each wrote is read back from TensorBoard's events.

The snippets are read from README.md itself, so editing one changes what runs here.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKED_BLOCK = re.compile(r"<!-- test_readme: (\S+) -->\n```\w*\n(.*?)\n```", re.DOTALL)


def readme_scripts() -> dict[str, tuple[str, str]]:
    """File name -> (its code, the command that runs it), in README order."""
    blocks = MARKED_BLOCK.findall((ROOT / "README.md").read_text())
    scripts, pending = {}, None
    for name, code in blocks:
        if name == "command":
            assert pending, f"a command block with no script before it: {code!r}"
            scripts[pending[0]] = (pending[1], code.strip())
            pending = None
        else:
            pending = (name, code)
    assert pending is None, f"README's {pending[0]} has no command block after it"
    return scripts


def run_pasted(name: str, folder: Path) -> subprocess.CompletedProcess:
    code, command = readme_scripts()[name]
    (folder / name).write_text(code + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore::UserWarning")
    result = subprocess.run(command, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = folder.rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def test_the_readme_marks_both_usage_snippets():
    scripts = readme_scripts()
    assert list(scripts) == ["train.py", "helpers.py"]
    assert all(command.startswith("torchrun ") for _, command in scripts.values())


def test_path_2_training_log_as_pasted(tmp_path):
    run_pasted("train.py", tmp_path)
    logged = scalars(tmp_path / "runs" / "mine" / "tensorboard")
    steps = list(range(1, 11))  # tensorboard_log_interval's default, 1: every iteration
    for tag in ("memory/peak_host_rss_gb", "memory/pp_stage_0/peak_host_rss_gb",
                "memory/pp_stage_1/peak_host_rss_gb", "memory/peak_stage/peak_host_rss_gb", "lm loss", "lr"):
        assert sorted(logged[tag]) == steps, tag
    for step in steps:
        stages = [logged[f"memory/pp_stage_{i}/peak_host_rss_gb"][step] for i in range(2)]
        assert logged["memory/peak_host_rss_gb"][step] == pytest.approx(max(stages))
        assert 0.05 < max(stages) < 64
    assert not any(tag.startswith("memory/") and "reserved" in tag for tag in logged)  # no CUDA: left out


def test_path_3_helpers_as_pasted(tmp_path):
    run_pasted("helpers.py", tmp_path)
    logged = scalars(tmp_path / "runs" / "helpers")
    # On CPU the CUDA peaks are missing on both ranks, so the reduction drops them (README):
    assert sorted(logged) == ["mem/peak_host_rss_gb"]
    assert sorted(logged["mem/peak_host_rss_gb"]) == [1, 2, 3]
    assert all(0.05 < value < 64 for value in logged["mem/peak_host_rss_gb"].values())


def test_the_cuda_peaks_without_cuda_are_nan_in_a_report_and_dropped_by_the_reduction(pp4):
    # What the README says of peak["peak_reserved_gb"] on CPU, on a real 4-rank group.
    report, reduced = pp4.run(_report_and_reduced)[0]
    assert math.isnan(report["peak_reserved_gb"]) and "peak_reserved_gb" not in reduced
    assert reduced["peak_host_rss_gb"] >= report["peak_host_rss_gb"] > 0


def _report_and_reduced():
    from megatron.core import parallel_state

    from nemo_memlog import reduce_max_memory_across_pp_group, report_memory

    report = report_memory()
    return report, reduce_max_memory_across_pp_group(report, parallel_state.get_pipeline_model_parallel_group())
