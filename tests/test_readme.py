"""The snippets of README.md and docs/*.md, run as written, and their links, followed.

Every ```python block in README.md and docs/*.md carries one of two markers on the line before it:

- ``<!-- test_readme: NAME -->``: runnable. The block is pasted into a file NAME in an empty
  folder, and the ``<!-- test_readme: command -->`` block after it is run there with bash
  (``-e``: every line must succeed), torchrun's 2 gloo processes on CPU where it says so, with
  this environment's bin on PATH (as after ``source .venv/bin/activate``).
- ``<!-- test_readme: not run: REASON -->``: a fragment that cannot run alone (it needs a whole
  Megatron-Bridge recipe, a Lightning ``Trainer(...)``); REASON names the test that covers it.

A python block with neither fails ``test_every_python_snippet_is_marked``. The README's two
scripts are read back from TensorBoard's events; a docs/ script passes when its command exits 0.
Every relative link (and its ``#anchor``) in those files must point at something that exists.
The snippets are read from the files themselves, so editing one changes what runs here.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.readback import main_run_events

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKED_BLOCK = re.compile(r"<!-- test_readme: (\S+) -->\n```\w*\n(.*?)\n```", re.DOTALL)
PYTHON_BLOCK = re.compile(r"^(.*)\n```python\n", re.MULTILINE)
RUN_MARKER = re.compile(r"<!-- test_readme: (\S+) -->")
SKIP_MARKER = re.compile(r"<!-- test_readme: not run: \S.* -->")
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def marked_scripts(path: Path = README) -> dict[str, tuple[str, str]]:
    """File name -> (its code, the command that runs it), in the file's order."""
    blocks = MARKED_BLOCK.findall(path.read_text())
    scripts, pending = {}, None
    for name, code in blocks:
        if name == "command":
            assert pending, f"{path.name}: a command block with no script before it: {code!r}"
            scripts[pending[0]] = (pending[1], code.strip())
            pending = None
        else:
            pending = (name, code)
    assert pending is None, f"{path.name}'s {pending[0]} has no command block after it"
    return scripts


def readme_scripts() -> dict[str, tuple[str, str]]:
    return marked_scripts(README)


def run_pasted(name: str, folder: Path, path: Path = README) -> subprocess.CompletedProcess:
    code, command = marked_scripts(path)[name]
    (folder / name).write_text(code + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore::UserWarning",
    )
    result = subprocess.run(["bash", "-ec", command], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = main_run_events(folder)
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def test_the_readme_marks_both_usage_snippets():
    scripts = readme_scripts()
    assert list(scripts) == ["train.py", "helpers.py"]
    assert all(command.startswith("torchrun ") for _, command in scripts.values())


@pytest.mark.processes
def test_path_2_training_log_as_pasted(tmp_path):
    run_pasted("train.py", tmp_path)
    logged = scalars(tmp_path / "runs" / "mine" / "tensorboard")
    steps = list(range(1, 11))  # tensorboard_log_interval's default, 1: every iteration
    for tag in (
        "memory/peak_host_rss_gb",
        "memory/pp_stage_0/peak_host_rss_gb",
        "memory/pp_stage_1/peak_host_rss_gb",
        "memory/peak_stage/peak_host_rss_gb",
        "lm loss",
        "lr",
    ):
        assert sorted(logged[tag]) == steps, tag
    for step in steps:
        stages = [logged[f"memory/pp_stage_{i}/peak_host_rss_gb"][step] for i in range(2)]
        assert logged["memory/peak_host_rss_gb"][step] == pytest.approx(max(stages))
        assert 0.05 < max(stages) < 64
    assert not any(tag.startswith("memory/") and "reserved" in tag for tag in logged)  # no CUDA: left out


@pytest.mark.processes
def test_path_3_helpers_as_pasted(tmp_path):
    run_pasted("helpers.py", tmp_path)
    logged = scalars(tmp_path / "runs" / "helpers")
    # On CPU the CUDA peaks are missing on both ranks, so the reduction drops them (README):
    assert sorted(logged) == ["mem/peak_host_rss_gb"]
    assert sorted(logged["mem/peak_host_rss_gb"]) == [1, 2, 3]
    assert all(0.05 < value < 64 for value in logged["mem/peak_host_rss_gb"].values())


@pytest.mark.processes
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


# --- docs/ --------------------------------------------------------------------------------------

DOC_SCRIPTS = [(doc, name) for doc in DOCS for name in marked_scripts(doc)]


def test_docs_has_runnable_snippets():
    names = {(doc.name, name) for doc, name in DOC_SCRIPTS}
    assert {("postmortem.md", "record.py"), ("configuration.md", "logger_config.py")} <= names


@pytest.mark.processes
@pytest.mark.parametrize("doc, name", DOC_SCRIPTS, ids=[f"{doc.name}:{name}" for doc, name in DOC_SCRIPTS])
def test_docs_snippet_as_pasted(doc, name, tmp_path):
    result = run_pasted(name, tmp_path, doc)
    if name == "record.py":  # one ring per rank, each closed: the post-mortem finds no failure
        records = tmp_path / "runs" / "my_job" / "memory_records"
        assert sorted(p.name for p in records.glob("*.memrec")) == ["rank-00000.memrec", "rank-00001.memrec"]
        assert "closed" in result.stdout


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_python_snippet_is_marked(path):
    for line_before in PYTHON_BLOCK.findall(path.read_text()):
        marked = RUN_MARKER.fullmatch(line_before) or SKIP_MARKER.fullmatch(line_before)
        assert marked, f"{path.name}: a python block without a test_readme marker, after {line_before!r}"


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors in ``path``: lower case, punctuation dropped, spaces -> '-'."""
    headings = re.findall(r"^#+ (.+)$", FENCED.sub("", path.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_points_at_something_that_exists(path):
    text = re.sub(r"`[^`\n]*`", "", FENCED.sub("", path.read_text()))
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.name}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{path.name}: link to {target}: no such heading"
