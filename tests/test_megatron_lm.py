"""nemo_memlog in Megatron-LM's own training loop (``megatron.training.pretrain`` -> ``train`` ->
``train_step`` -> ``training_log``, from the megatron-core 0.19.2 wheel), PP 2 on CPU under torchrun,
through both ways in at once: ``nemo-memlog run --`` around the launch, and ``megatron_lm.install()``
in the script as well (as a user who adds the prefix to a script that installs does). The script is
the project's own (nemo_memlog.testing.megatron.lm_job).

Held against what is made apart: Megatron-LM's own ``lm loss`` without the flag; every tensor
autograd saved, counted around ``train_step`` (the job's ``--count-apart``); Megatron's own warm-up
count; each stage's own run. The 0.16.1 environment has no Megatron-LM loop: skipped there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_memlog.integrations import megatron_lm
from nemo_memlog.offline import events, report
from nemo_memlog.offline.rank_files import read_rank_file
from nemo_memlog.testing import torchrun
from nemo_memlog.testing.megatron import lm_stand_ins as megatron_lm_stand_ins
from tests import readback

pytestmark = [
    pytest.mark.processes,
    pytest.mark.slow,
    pytest.mark.skipif(not megatron_lm_stand_ins.has_loop(), reason="Megatron-LM's loop ships in megatron-core 0.17+"),
]

JOB = ("-m", "nemo_memlog.testing.megatron.lm_job")
#: ``--cpu``: the CPU stand-ins come from run's switch, not the job (which installs them only without it).
RUN = (sys.executable, "-m", "nemo_memlog.cli", "run", "--cpu", "--")
#: Megatron-LM's own flags: a 4-layer GPT, PP 2, 4 microbatches of 2, 4 iterations, on CPU.
MODEL = (
    *("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64"),
    *("--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64"),
    *("--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-4"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--log-interval", "1"),
    *("--distributed-backend", "gloo", "--transformer-impl", "local", "--no-persist-layer-norm"),
    *("--no-gradient-accumulation-fusion", "--eval-interval", "100"),  # the loop divides by the interval
    # One iteration for each evaluation, the valid and test ones after the last iteration too: Megatron-LM's
    # default of 100 made them 800 of a run's 816 forward steps (about 9 of its 39 CPU-seconds).
    *("--eval-iters", "1"),
)
#: A checkpoint and an evaluation at iteration 2 (the last --eval-interval counts): the phases.
PHASES = ("--save-interval", "2", "--ckpt-format", "torch", "--eval-interval", "2")
FLAG = "--log-memory-to-tensorboard"
INTERLEAVED = ("--num-layers-per-virtual-pipeline-stage", "1")
#: name -> (the launcher before torchrun, the job's flags beyond MODEL). Two launches, both through the
#: front door on the interleaved schedule (the harder in-flight count; 1F1B's is held in test_megatron.py,
#: test_demo.py and test_fit.py): Megatron-LM's own reference, and the same run with the flag, where the
#: script also calls install() (what run already did: the same callback, no second series), then reloads
#: the loop module (importlib.reload) and installs again (said once per rank, wrapped anew).
RUNS = {
    "run, without the flag": (RUN, (*PHASES, "wandb", *INTERLEAVED)),
    "run and install, interleaved": (RUN, (*PHASES, "wandb", *INTERLEAVED, FLAG, "--nemo-memlog", "--reload-loop")),
}
WITH_FLAG = [name for name in RUNS if FLAG in RUNS[name][1]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(name)``: run ``name`` of RUNS once, at its first use: its root folder (its output
    in ``root / "output.txt"``)."""
    roots: dict = {}

    def train(name: str) -> Path:
        if name not in roots:
            prefix, flags = RUNS[name]
            root = tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", ""))
            own = ["--tensorboard-dir", root / "tb", "--count-apart", root / "apart"]
            if "wandb" in flags:
                own += ["--wandb-project", "memlog", "--wandb-exp-name", "e", "--wandb-save-dir", root / "wandb"]
            if "--save-interval" in flags:
                own += ["--save", root / "checkpoints"]
                # Megatron-LM's own race (NVIDIA/Megatron-LM#1653, open): after a save, rank 0 writes the
                # tracker file while the last rank adds it to a W&B artifact, which fails where it is not
                # there yet ("ValueError: Path is not a file"; CI's run, rank 1). One written before the
                # run is there at every save; no --load, so nothing reads it.
                (root / "checkpoints").mkdir()
                (root / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("0")
            done = torchrun.run(
                *JOB,
                *MODEL,
                *[flag for flag in flags if flag != "wandb"],
                *own,
                prefix=prefix,
                env={"WANDB_MODE": "offline"},
                timeout_s=300,
            )
            assert done.returncode == 0, f"{name}: torchrun exited with {done.returncode}:\n{torchrun.tail(done)}"
            (root / "output.txt").write_text(done.stdout + done.stderr)
            roots[name] = root
        return roots[name]

    return train


def _wandb_rows(root: Path) -> dict[int, dict]:
    """{step: every key W&B stored at it} from the one offline run under ``root``."""
    logs = list((root / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs  # one W&B run: Megatron-LM's own
    rows: dict[int, dict] = {}
    for record in readback.wandb_records(logs[0]):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(int(items["_step"]), {}).update(items)
    return rows


def _stages(root: Path) -> dict[int, dict]:
    """pp stage -> (its per-layer record's stage figures, the count made apart on its rank)."""
    records = {}
    for path in (root / "memory_records").glob("rank-*.layers.json"):
        record = json.loads(path.read_text())
        apart = json.loads((root / "apart" / f"rank-{record['rank']}.json").read_text())
        records[record["pp_rank"]] = {**record, "apart": apart}
    return records


def test_losses_are_megatron_lms_own_and_without_the_flag_nothing_is_written(trained):
    without, with_us = trained("run, without the flag"), trained("run and install, interleaved")
    runs = readback.tensorboard_runs(without / "tb")
    assert list(runs) == ["."]  # Megatron-LM's run alone: no stage runs
    assert not [tag for tag in runs["."] if tag.startswith(("memory/", "mem-"))]
    assert not (without / "memory_records").exists()  # no flight record
    assert not [key for row in _wandb_rows(without).values() for key in row if key.startswith("memory/")]
    losses = runs["."]["lm loss"]
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert readback.tensorboard_runs(with_us / "tb")["."]["lm loss"] == losses  # bit for bit
    # Without the flag: one notice, on the last rank (the writer's), naming the flag to add.
    assert (without / "output.txt").read_text().count(megatron_lm.FLAG_OFF) == 1
    assert megatron_lm.FLAG_OFF not in (with_us / "output.txt").read_text()


def test_install_on_a_reloaded_loop_says_so_once_per_rank_and_wraps_it_again(trained):
    output = (trained("run and install, interleaved") / "output.txt").read_text()
    assert output.count(megatron_lm.RELOADED) == 2  # one notice in each of the 2 ranks
    assert megatron_lm.TOO_LATE not in output  # before pretrain: in time
    # Wrapped again, once: the series of that run are the ones the tests above read, each at each step once.


@pytest.mark.parametrize("name", WITH_FLAG)
def test_the_memory_series_are_at_the_steps_of_lm_loss_once_each_in_megatron_lms_own_run(trained, name):
    root = trained(name)
    runs = readback.tensorboard_runs(root / "tb")
    assert sorted(runs) == [".", "pp_stage_0", "pp_stage_1"]  # Megatron-LM's run, and one run per stage
    assert len(list((root / "tb").glob("events.out.tfevents.*"))) == 1  # no second main run
    main = runs["."]
    loss_steps = [step for step, _ in main["lm loss"]]
    series = [tag for tag in main if tag.startswith("memory/") and "/phase/" not in tag]
    for tag in ("memory/peak_host_rss_gb", "memory/activations_gb", "memory/microbatches_in_flight"):
        assert tag in series
    for tag in series:
        assert [step for step, _ in main[tag]] == loss_steps, tag  # each once, at exactly those steps
    assert not [tag for tag in main if tag.startswith("mem-")]  # no device statistics: none from one rank
    if "wandb" in RUNS[name][1]:
        rows = _wandb_rows(root)
        for tag in series:
            assert sorted(step for step, row in rows.items() if tag in row) == loss_steps, tag
            assert sorted(step for step, row in rows.items() if "lm loss" in row) == loss_steps
        assert not [key for row in rows.values() for key in row if key.startswith("mem-")]


@pytest.mark.parametrize("name", WITH_FLAG)
def test_the_max_is_the_max_of_the_stages_and_each_stage_run_holds_its_own(trained, name):
    runs = readback.tensorboard_runs(trained(name) / "tb")
    main = runs["."]
    per_stage = sorted({tag.split("/", 2)[2] for tag in main if tag.startswith("memory/pp_stage_")})
    assert "activations_gb" in per_stage and "peak_host_rss_gb" in per_stage
    for key in per_stage:
        stage_values = [dict(main[f"memory/pp_stage_{stage}/{key}"]) for stage in (0, 1)]
        for step, value in main[f"memory/{key}"]:
            assert value == max(values[step] for values in stage_values), (key, step)
        for stage in (0, 1):
            assert runs[f"pp_stage_{stage}"][f"memory/{key}"] == main[f"memory/pp_stage_{stage}/{key}"]


@pytest.mark.parametrize("name", WITH_FLAG)
def test_activations_and_in_flight_match_the_count_made_apart_and_megatrons_schedule(trained, name):
    stages = _stages(trained(name))
    assert sorted(stages) == [0, 1]
    for stage, record in stages.items():
        figures, apart = record["stage"], record["apart"]
        counted = apart["saved_peak_bytes"][str(record["iteration"])]
        assert figures["activations_gb"] == pytest.approx(counted / 1e9, rel=0.01), stage
        assert figures["microbatches_in_flight"] == apart["expected_in_flight"], stage
        facts = record["run"]
        assert facts["framework"] == "megatron-lm" and facts["micro_batch_size"] == 2 and facts["microbatches"] == 4
        assert facts["schedule"] == ("interleaved" if "interleaved" in name else "1f1b")
    assert stages[0]["stage"]["activations_gb"] > stages[1]["stage"]["activations_gb"]  # the peak lives on stage 0


def test_checkpoint_saves_and_evaluation_are_phases_and_the_offline_commands_read_the_run(trained):
    root = trained("run and install, interleaved")
    main = readback.tensorboard_runs(root / "tb")["."]
    for name in ("checkpoint_save", "eval"):
        assert main[f"memory/phase/{name}/seconds"], name  # measured on the save and the evaluation at 2
    # The evaluations at the last iteration (in train(), then pretrain's on the valid and test sets, after
    # train() returned: no logging step follows them) are phases too, each written at that iteration, as
    # Megatron-LM writes its own validation loss: one point per evaluation, counted apart by Megatron-LM.
    last = max(step for step, _ in main["lm loss"])
    evaluations = [step for step, _ in main["lm loss validation"]].count(last)
    assert evaluations == 3  # at 4 in train(), then valid and test
    assert [step for step, _ in main["memory/phase/eval/seconds"]] == [3] + [last] * evaluations  # 2's at 3
    assert [step for step, _ in main["memory/peak_stage/phase/eval/seconds"]] == [3] + [last] * evaluations
    for path in (root / "memory_records").glob("rank-*.memrec"):  # what a post-mortem of a kill mid-save reads
        records = read_rank_file(path).records
        phases = [(r["name"], r["event"], r["iteration"]) for r in records if r["kind"] == "phase"]
        assert ("checkpoint_save", "start", 2) in phases and ("checkpoint_save", "end", 2) in phases, path
        assert ("eval", "start", 2) in phases, path
        assert phases.count(("eval", "start", last)) == phases.count(("eval", "end", last)) == evaluations, path
    # The run config is in Megatron-LM's own TensorBoard run: report names the peak window.
    assert report.peak_window_line(events.load_run(root / "tb")).startswith("peak window: run (")
    cli = [sys.executable, "-m", "nemo_memlog.cli"]
    advised = subprocess.run([*cli, "advise", root / "tb"], capture_output=True, text=True, timeout=120)
    assert advised.returncode == 0, advised.stderr
    assert "stage 0" in advised.stdout and "microbatches in flight" in advised.stdout
    postmortem = subprocess.run([*cli, "postmortem", root], capture_output=True, text=True, timeout=120)
    assert postmortem.returncode == 0, postmortem.stderr  # 0: no failure, every rank ended cleanly
    assert "2 of 2 ranks read" in postmortem.stdout


#: In one process, no launch: the notices' words, with Megatron-LM's own loop module and global args.
NOTICES = """
import json, logging
from types import SimpleNamespace
from nemo_memlog.testing.megatron import lm_job as megatron_lm_job, lm_stand_ins as megatron_lm_stand_ins
megatron_lm_job.hide_modelopt()
megatron_lm_stand_ins.install()
import os
import megatron.training.training as training
from megatron.training import global_vars
from nemo_memlog import megatron_lm
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("nemo_memlog").addHandler(Keep())
# NEMO_MEMLOG_DISABLED: install() rebinds nothing, reads no setting (this one cannot work) and says nothing
loop = {name: getattr(training, name) for name in megatron_lm.WRAPPED}
os.environ["NEMO_MEMLOG_DISABLED"] = "true"
off = megatron_lm.install(memory_reduce_timeout_s=-1)
unbound = off.stopped and all(getattr(training, name) is function for name, function in loop.items())
del os.environ["NEMO_MEMLOG_DISABLED"]
off_said = len(said)
# install() from inside a train of the loop's module: too late for that train
space = {"__name__": training.__name__, "install": megatron_lm.install}
exec("def train():\\n    return install()", space)
callback = space["train"]()
wrapped = getattr(training.train, megatron_lm.MARK, None) is callback
# Megatron-LM's --tensorboard-log-interval 0 with the flag: the run cannot open
global_vars.set_args(SimpleNamespace(log_memory_to_tensorboard=True, tensorboard_log_interval=0,
                                     tensorboard_dir=None, wandb_save_dir=None))
callback.on_train_start(None, None)
callback.on_log(1)  # stopped: nothing, no second notice
callback.on_train_end()
print(json.dumps({"said": said, "wrapped": wrapped, "stopped": callback.stopped, "monitor": callback.monitor,
                  "unbound": unbound, "off_said": off_said}))
"""


def test_a_framework_argument_that_cannot_work_and_a_late_install_are_one_notice_each():
    done = subprocess.run(
        [sys.executable, "-c", NOTICES], capture_output=True, text=True, timeout=120, env=torchrun.torchrun_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["unbound"] and found["off_said"] == 0  # NEMO_MEMLOG_DISABLED: Megatron-LM's loop as it was
    assert found["wrapped"] and found["stopped"] and found["monitor"] is None
    said = found["said"]
    assert said[0] == megatron_lm.TOO_LATE
    assert len(said) == 2, said  # one each: the interval's failure is said once, not at every event
    assert said[1].startswith("nemo_memlog: memory logging stopped in Megatron-LM's loop (on_train_start): ")
    assert "tensorboard_log_interval must be an int >= 1" in said[1] and said[1].endswith("training goes on without it")
