"""End to end: ``python scripts/demo.py ...`` run exactly as a user would (it re-launches
itself under torchrun, 4 gloo processes, PP 4: megatron-core's GPTModel, DDP, optimizer and
1F1B schedule through megatron_cpu's stand-ins), then its TensorBoard events read back; then
a second run in a row, on Megatron's interleaved schedule (``parallel.vpp=2``), its closing
lines' commands run as printed and ``nemo-memlog report``.

Smaller than the default job so it takes seconds, not a minute, with interval peaks
(``logger.memory_peak_window=interval``; the default, "run", is the demo of test_sigterm.py),
and TensorBoard is the only backend: the others add time, and their memory on the writer rank (the last stage)
would need bigger activations to stay below the first stage's. Each backend's own handling
(secrets included) is tested in tests/writers/, all four under the demo in test_sigterm.py.
The failure demo (``fail.kill_stage=0``) and its post-mortem are test_teardown.py's.
"""

import math
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.commands import run_as_printed, run_demo
from tests.readback import main_run_events

ROOT = Path(__file__).resolve().parents[1]
ITERS, INTERVAL, STAGES, VOCAB = 5, 2, 4, 128
LOGGED_STEPS = [2, 4]  # iteration % INTERVAL == 0, iterations counted from 1
PEAK = "peak_host_rss_gb"
SECRET = "SECRET-DEMO-KEY"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(result, run folder, scalars) of the demo with no run.name: the first of two_runs below."""
    root = tmp_path_factory.mktemp("runs")
    result = run_demo(
        f"run.root={root}",
        f"train.iters={ITERS}",
        f"logger.tensorboard_log_interval={INTERVAL}",
        "train.micro_batch_size=32",
        f"model.vocab={VOCAB}",
        "logger.memory_peak_window=interval",
        "logger.wandb_project=null",
        "logger.mlflow_experiment=null",
        "logger.comet_project=null",
        f"logger.comet_api_key={SECRET}",  # recorded with the run config: must come out redacted
    )
    assert result.returncode == 0, f"demo failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    run = printed_run_folder(result.stdout)
    assert run.parent == root
    accumulator = EventAccumulator(str(run / "tensorboard"))
    accumulator.Reload()
    scalars = {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]
    }
    return result, run, scalars


def printed_run_folder(stdout: str) -> Path:
    """The folder the closing lines name as this run's."""
    (match,) = re.findall(r"^This run's folder: (\S+)", stdout, re.MULTILINE)
    return Path(match)


@pytest.mark.processes
@pytest.mark.slow
def test_memory_and_caller_metrics_logged_at_exactly_the_logging_steps(demo):
    _, _, scalars = demo
    # (A phase's series are logged at the logging steps after it ran only: see the checkpoint test.)
    memory_tags = [tag for tag in scalars if tag.startswith("memory/") and "phase/" not in tag]
    assert f"memory/{PEAK}" in memory_tags
    for tag in memory_tags + ["loss", "lr"]:
        assert sorted(scalars[tag]) == LOGGED_STEPS, tag


@pytest.mark.processes
@pytest.mark.slow
def test_pipeline_peak_is_the_max_of_the_stage_peaks(demo):
    _, _, scalars = demo
    for step in LOGGED_STEPS:
        stages = [scalars[f"memory/pp_stage_{i}/{PEAK}"][step] for i in range(STAGES)]
        assert scalars[f"memory/{PEAK}"][step] == pytest.approx(max(stages), rel=1e-6)
        assert scalars[f"memory/peak_stage/{PEAK}"][step] == stages.index(max(stages))


@pytest.mark.processes
@pytest.mark.slow
def test_first_stage_holds_more_than_the_last(demo):
    # 1F1B: the first stage keeps 4 microbatches' activations alive, the last stage 1.
    _, _, scalars = demo
    step = LOGGED_STEPS[-1]
    assert scalars[f"memory/pp_stage_0/{PEAK}"][step] > scalars[f"memory/pp_stage_{STAGES - 1}/{PEAK}"][step]


@pytest.mark.processes
@pytest.mark.slow
def test_activations_measured_on_every_stage_held_for_the_microbatches_in_flight(demo):
    """1F1B measured, not assumed: stage s holds PP - s microbatches at once, and stages 1 and 2
    (the same blocks) keep the same bytes per microbatch, so their activations stand 3 : 2."""
    _, _, scalars = demo
    for step in LOGGED_STEPS:  # each armed by the call at the iteration before it
        in_flight = [scalars[f"memory/pp_stage_{s}/microbatches_in_flight"][step] for s in range(STAGES)]
        assert in_flight == [4, 3, 2, 1]
        held = [scalars[f"memory/pp_stage_{s}/activations_gb"][step] for s in range(STAGES)]
        per_microbatch = [scalars[f"memory/pp_stage_{s}/activations_per_microbatch_gb"][step] for s in range(STAGES)]
        # rel 1e-3: a storage several microbatches keep is held once (measure/activations.py)
        assert held[1] / held[2] == pytest.approx(1.5, rel=1e-3) and per_microbatch[1] == per_microbatch[2]
        assert held[0] == pytest.approx(4 * per_microbatch[0], rel=1e-3)
        assert scalars["memory/peak_stage/activations_gb"][step] == 0


@pytest.mark.processes
@pytest.mark.slow
def test_the_checkpoint_save_is_a_memory_phase_logged_with_its_peak_and_stage(demo):
    """train.save_every=4 (the default): each stage saves at iteration 4 inside memory_phase."""
    _, run, scalars = demo
    save = scalars["memory/phase/checkpoint_save/peak_host_rss_gb"]
    assert list(save) == [4], "saved at 4, a logging step (INTERVAL 2): logged there, once"
    assert scalars["memory/peak_stage/phase/checkpoint_save/peak_host_rss_gb"][4] in range(STAGES)
    assert 0.1 < save[4] <= scalars[f"memory/{PEAK}"][4] + 1e-6  # within the interval's own peak
    assert len(list((run / "checkpoints" / "iter-00004").glob("stage-*-dp-*.pt"))) == STAGES


@pytest.mark.processes
@pytest.mark.slow
def test_the_demo_passes_its_model_and_the_report_draws_each_stages_composition(demo, tmp_path, capsys):
    """Stage 0 holds the embedding, the last stage the output layer: their model state is larger."""
    from nemo_memlog.cli import main

    _, run, scalars = demo
    last = LOGGED_STEPS[-1]
    params = [scalars[f"memory/pp_stage_{s}/params_gb"][last] for s in range(STAGES)]
    assert params[0] > params[1] == pytest.approx(params[2]) and params[3] > params[2]
    state = [scalars[f"memory/pp_stage_{s}/model_state_gb"][last] for s in range(STAGES)]
    assert scalars["memory/peak_stage/model_state_gb"][last] == state.index(max(state))
    assert "memory/temporaries_gb" not in scalars  # CPU stages: no allocator peak
    assert main(["report", str(run), "--png", str(tmp_path / "r.png")]) == 0
    assert f"what each stage's memory is made of: {tmp_path / 'r_composition.png'}" in capsys.readouterr().out
    assert (tmp_path / "r_composition.png").stat().st_size > 10_000


@pytest.mark.processes
@pytest.mark.slow
def test_megatrons_stack_trains_through_the_named_stand_ins(demo):
    """The stand-ins are named once, at start; the job's facts (for advise) are Megatron's 1F1B job's."""
    from nemo_memlog.measure import layer_record
    from nemo_memlog.testing.megatron import cpu as megatron_cpu

    result, run, _ = demo
    assert result.stdout.count(f"demo.py: {megatron_cpu.summary()}") == 1
    assert "PP 4, 1F1B" in result.stderr  # the progress bar
    for rank in range(STAGES):  # the per-layer record advise reads, with the facts the demo states
        record = layer_record.read_rank(str(run / "memory_records"), rank)
        assert record["run"]["schedule"] == "1f1b" and record["run"]["micro_batch_size"] == 32, rank
        assert record["run"]["distributed_optimizer"] is False and record["layers"], rank


@pytest.mark.processes
@pytest.mark.slow
def test_loss_falls_below_chance(demo):
    _, _, scalars = demo
    assert scalars["loss"][LOGGED_STEPS[-1]] < math.log(VOCAB)


@pytest.mark.processes
@pytest.mark.slow
def test_the_table_and_the_dashboard_command_are_printed(demo):
    result, _, scalars = demo
    stdout = result.stdout
    step = LOGGED_STEPS[-1]
    assert f"Peak host RSS per pipeline stage at iteration {step} (since the previous logging step)" in stdout
    for stage in range(STAGES):
        assert f"{scalars[f'memory/pp_stage_{stage}/{PEAK}'][step]:.3f} GB" in stdout
    assert f"memory/{PEAK} = {scalars[f'memory/{PEAK}'][step]:.3f} GB" in stdout
    assert "tensorboard --logdir " in stdout


@pytest.mark.processes
@pytest.mark.slow
def test_the_report_names_the_interval_window_recorded_with_the_run_config(demo, capsys):
    from nemo_memlog.cli import main

    _, run, _ = demo
    assert main(["report", str(run), "--png", str(run / "report.png")]) == 0
    assert "peak window: interval" in capsys.readouterr().out
    assert b"peak window: interval" in (run / "report.png").read_bytes()


def test_an_unknown_override_is_refused_before_any_process_starts(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # main() sets these defaults: keep them out of this process
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("RANK", raising=False)
    import demo as demo_script

    monkeypatch.setattr(demo_script, "relaunch", lambda *_: pytest.fail("launched despite a bad override"))
    assert demo_script.main(["train.iterz=3"]) == 2
    assert "'iterz' not in 'TrainConfig'" in capsys.readouterr().err


@pytest.mark.processes
@pytest.mark.slow
def test_a_secret_on_the_command_line_is_written_nowhere(demo):
    result, run, _ = demo
    written = [path for path in run.rglob("*") if path.is_file()]
    assert written, "the run wrote nothing"
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in result.stdout + result.stderr


# ---- the demo twice in a row, as a newcomer runs it ----------------------------------------
# The second run follows the first (the `demo` fixture, no run.name either) into the same
# run.root, with all four backends, the default peak window, Megatron's interleaved schedule
# (parallel.vpp=2) on PP 2 with 2 processes (parallel.processes=2: half the first run's) and fewer
# iterations, starting over at
# step 1: the case that used to be stitched onto the first run's steps and called "resumed"
# ("interval -> run").


@pytest.fixture(scope="module")
def two_runs(demo):
    """(the runs' root, first run's stdout, second run's result)."""
    first, first_run, _ = demo
    second = run_demo(
        f"run.root={first_run.parent}",
        "parallel.pp=2",  # 2 ranks: the interleaved schedule and the four backends need no more
        "parallel.processes=2",
        "parallel.vpp=2",
        "train.iters=2",
        "train.micro_batch_size=16",
        "train.seq_len=32",
        f"model.vocab={VOCAB}",
    )
    assert second.returncode == 0, f"demo failed:\n{second.stdout[-3000:]}\n{second.stderr[-3000:]}"
    return first_run.parent, first.stdout, second


def command_after(stdout: str, heading: str) -> list[str]:
    """The indented command lines printed under ``heading``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        commands.append(line.strip())
    return commands


@pytest.mark.processes
@pytest.mark.slow
def test_the_second_run_trains_on_the_interleaved_schedule(two_runs):
    _, _, second = two_runs
    assert "PP 2, interleaved, VPP 2" in second.stderr  # the progress bar
    assert "Peak host RSS per pipeline stage at iteration 2" in second.stdout


@pytest.mark.processes
@pytest.mark.slow
def test_each_run_writes_into_a_folder_of_its_own(two_runs):
    root, first_stdout, second = two_runs
    folders = sorted(path for path in root.iterdir() if path.is_dir())
    assert len(folders) == 2 and all(re.fullmatch(r"demo-\d{8}-\d{6}(-\d+)?", path.name) for path in folders)
    assert {printed_run_folder(first_stdout), printed_run_folder(second.stdout)} == set(folders)
    for folder in folders:
        assert len(main_run_events(folder)) == 1, folder


@pytest.mark.processes
@pytest.mark.slow
def test_the_printed_report_command_works_as_printed_and_shows_one_run(two_runs):
    _, _, second = two_runs
    (command,) = command_after(second.stdout, "Per-stage table and PNG of this run:")
    assert command.split()[0].endswith("nemo-memlog") and Path(command.split()[0]).exists()
    report = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "steps 1..2 (2 logged)" in report.stdout
    assert "peak window: run (each peak_* point is the peak since its process started)" in report.stdout
    assert "resumed" not in report.stdout and "NOTE" not in report.stdout


@pytest.mark.processes
@pytest.mark.slow
def test_report_on_the_folder_of_both_runs_shows_the_newest_and_names_the_other(two_runs, capsys):
    from nemo_memlog.cli import main

    root, first_stdout, _ = two_runs
    assert main(["report", str(root), "--png", str(root / "both.png")]) == 0
    out = capsys.readouterr().out
    assert f"NOTE: {root} holds 2 runs" in out
    assert "steps 1..2 (2 logged)" in out and "peak window: run (" in out  # the newest run only
    (first_events,) = main_run_events(printed_run_folder(first_stdout))
    assert re.search(rf"steps 2\.\.4, started .*: {re.escape(str(first_events))}", out)
    assert "resumed" not in out
    # The ignored run, reported on its own by passing its event file:
    assert main(["report", str(first_events)]) == 0
    out = capsys.readouterr().out
    assert "steps 2..4 (2 logged)" in out and "peak window: interval (" in out and "NOTE" not in out


@pytest.mark.processes
@pytest.mark.slow
def test_the_dashboard_commands_are_printed_with_working_paths_and_the_account_note(two_runs):
    _, _, second = two_runs
    run = printed_run_folder(second.stdout)
    local = command_after(second.stdout, "Open the dashboards (no account needed):")
    uploads = command_after(second.stdout, "W&B and Comet wrote offline copies; uploading them needs an account")
    assert [Path(command.split()[0]).name for command in local] == ["tensorboard", "mlflow"]
    assert [Path(command.split()[0]).name for command in uploads[:2]] == ["wandb", "comet"]
    for command in local + uploads[:2]:
        assert Path(command.split()[0]).is_file(), command  # the venv's own, not a bare name off PATH
    assert uploads[2] == "without an account, the same series are in the TensorBoard and MLflow dashboards above"
    tensorboard = shlex.split(local[0]) + ["--inspect"]  # as printed; --inspect reads the events and exits
    inspected = subprocess.run(tensorboard, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert inspected.returncode == 0 and "memory/peak_host_rss_gb" in inspected.stdout, inspected.stderr[-2000:]
    assert Path(local[1].split("sqlite:///")[1]).is_file()
    assert Path(uploads[0].split()[-1]).is_dir() and Path(uploads[1].split()[-1]).is_file()
    assert all(str(run) in command for command in local + uploads[:2])


@pytest.mark.processes
@pytest.mark.slow
def test_every_printed_command_runs_as_printed(demo):
    """The in-run note (rank 0, stderr), the closing lines' report and post-mortem commands."""
    result, run, _ = demo
    (note,) = re.findall(r"nemo_memlog: memory flight records in \S+ \(after a failure: (.+)\)$", result.stderr, re.M)
    (report,) = command_after(result.stdout, "Per-stage table and PNG of this run:")
    (postmortem,) = command_after(result.stdout, "After a failure, which rank failed first and what every rank held")
    assert note == postmortem and str(run / "memory_records") in postmortem
    for command in (report, postmortem):
        done = run_as_printed(command)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        if command == report:  # its footer's post-mortem command too
            (footer,) = re.findall(r"flight records found under \S+: `([^`]+)` says which rank", done.stdout)
            assert run_as_printed(footer).returncode == 0, footer
    assert "no failure: all 4 ranks recorded a clean end (4 closed by the run)" in done.stdout


@pytest.mark.processes
@pytest.mark.slow
def test_no_backend_info_lines_in_the_output(two_runs):
    _, _, second = two_runs
    output = second.stdout + second.stderr
    assert "COMET INFO" not in output and not re.search(r"\bINFO mlflow", output), output[-3000:]
    assert "Transformer Engine and Apex" not in output  # megatron-core's warning, quieted in the demo only


@pytest.fixture
def demo_script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import demo

    return demo


@pytest.mark.processes
@pytest.mark.slow
def test_an_existing_run_name_is_refused_before_any_process_starts(two_runs, demo_script, monkeypatch, capsys):
    root, first_stdout, _ = two_runs
    name = printed_run_folder(first_stdout).name
    monkeypatch.setenv("WANDB_MODE", "offline")  # main() sets these defaults: keep them out of this process
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("COMET_LOGGING_CONSOLE", "WARNING")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(demo_script, "relaunch", lambda *_: pytest.fail("launched into a used folder"))
    assert demo_script.main([f"run.root={root}", f"run.name={name}"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "run.overwrite=true" in err


def test_run_folders_are_claimed_once_and_overwrite_starts_again(demo_script, tmp_path):
    RunConfig, claim = demo_script.RunConfig, demo_script.claim_run_dir
    first = claim(RunConfig(root=str(tmp_path)))
    second = claim(RunConfig(root=str(tmp_path)))  # same second: a suffix, never the same folder
    assert first != second and second.startswith(first)
    (tmp_path / first / "events").write_text("old run")
    with pytest.raises(demo_script.ConfigError, match="already holds a run"):
        claim(RunConfig(root=str(tmp_path), name=first))
    assert claim(RunConfig(root=str(tmp_path), name=second)) == second  # claimed but empty: the launcher's
    assert claim(RunConfig(root=str(tmp_path), name=first, overwrite=True)) == first
    assert list((tmp_path / first).iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train.foo=1"], "Key 'foo' not in 'TrainConfig'; train keys: iters, micro_batches, micro_batch_size"),
        (["model.hiden=8"], "(did you mean 'hidden'?); model keys: hidden, layers_per_stage, vocab, heads"),
        (["parallel.p=2"], "parallel keys: pp"),
        (["run.nam=x"], "(did you mean 'name'?); run keys: name, root, overwrite"),
        (["trian.iters=1"], "no section 'trian' (did you mean 'train'?)"),
        (["logger.tensorboard_log_intervall=2"], "(did you mean 'tensorboard_log_interval'?)"),
        (
            ["parallel.pp=3"],
            "choose parallel.pp among 1, 2, 4, or parallel.processes=3 (or a multiple of it), or start",
        ),
        (
            ["parallel.processes=2"],
            "parallel.pp (4) must divide the number of processes (2): choose parallel.pp among 1, 2,",
        ),
        (["parallel.processes=0"], "parallel.processes must be >= 1; got 0"),
        (["parallel.vpp=4"], "parallel.vpp (4) must divide model.layers_per_stage (2)"),
        (["parallel.vpp=2", "train.micro_batches=6"], "train.micro_batches (6) to be a multiple of parallel.pp (4)"),
        (["parallel.vpp=2", "parallel.pp=1"], "needs parallel.pp >= 2"),
    ],
)
def test_bad_overrides_name_the_valid_keys(demo_script, argv, message):
    with pytest.raises(demo_script.ConfigError) as error:
        demo_script.load_config(argv)
    assert message in str(error.value)
    if argv == ["parallel.pp=3"]:
        assert "torchrun --nproc-per-node N scripts/demo.py parallel.pp=3" in str(error.value)


def test_under_a_torchrun_of_yours_its_count_is_the_processes(demo_script, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(demo_script.ConfigError) as error:
        demo_script.load_config(["parallel.processes=2"])
    assert "parallel.processes=2, but torchrun started 4 processes: leave parallel.processes out" in str(error.value)
    assert demo_script.processes(demo_script.load_config(["parallel.processes=4"])) == 4
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert demo_script.processes(demo_script.load_config(["parallel.pp=2"])) == 2
    with pytest.raises(demo_script.ConfigError) as error:
        demo_script.load_config([])  # PP 4 on torchrun's 2: its own count is the one to change, not ours
    assert "or start the demo on N processes yourself" in str(error.value)
    assert "parallel.processes" not in str(error.value)


def test_help_lists_every_key_with_its_default(demo_script):
    import dataclasses

    import nemo_memlog

    text = demo_script.help_text()
    for section, schema in demo_script.SECTIONS.items():
        for spec in dataclasses.fields(schema):
            assert re.search(rf"^  {section}\.{spec.name}=\S", text, re.MULTILINE), (section, spec.name)
    for spec in dataclasses.fields(nemo_memlog.LoggerConfig):
        assert re.search(rf"^  logger\.{spec.name}=\S", text, re.MULTILINE), spec.name
    assert "  train.iters=8 " in text and "  parallel.pp=4 " in text and "  run.root=runs " in text
    assert "  logger.log_memory_to_tensorboard=true " in text and "  logger.memory_peak_window=run " in text


def test_the_failure_demo_kills_its_stage_in_the_middle_of_the_run_unless_told(demo_script):
    """fail.kill_at's default (test_teardown.py runs the failure demo with it given)."""
    assert demo_script.load_config(["fail.kill_stage=0", "train.iters=4"]).fail.kill_at == 3
    assert demo_script.load_config(["fail.kill_stage=0", "fail.kill_at=30", "train.iters=40"]).fail.kill_at == 30


@pytest.mark.parametrize("exit_code", [1, 0])
def test_the_failure_demos_launcher_says_when_its_stage_dies_and_prints_the_post_mortem(
    demo_script, monkeypatch, capsys, tmp_path, exit_code
):
    """The launcher's side of ``fail.kill_stage=0``, its torchrun faked (test_teardown.py runs the
    post-mortem of a rank 0 SIGKILLed under the demo, as a user pastes the printed command)."""
    import nemo_memlog.config

    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true")):
        monkeypatch.setenv(name, value)  # main() sets these defaults: keep them out of this process
    monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("COMET_LOGGING_CONSOLE", "WARNING")
    monkeypatch.delenv("RANK", raising=False)
    launched = []

    def torchrun(overrides, nproc, log=None):  # the job: its flight records, then torchrun's exit code
        launched.append((overrides, nproc, log))
        cfg = demo_script.load_config(overrides)
        Path(nemo_memlog.config.resolve(cfg.logger).record_dir).mkdir(parents=True)
        return exit_code

    monkeypatch.setattr(demo_script, "relaunch", torchrun)
    code = demo_script.main([f"run.root={tmp_path}", "run.name=failing", "fail.kill_stage=0", "train.iters=4"])
    out, err = capsys.readouterr()
    assert "stage 0's first rank SIGKILLs itself at iteration 3 of 4" in out
    ((overrides, nproc, log),) = launched
    assert nproc == demo_script.DEFAULT_PROCESSES
    assert "fail.kill_stage=0" in overrides and log == tmp_path / "failing" / demo_script.LAUNCH_LOG
    if exit_code == 0:
        assert code == 1 and "the job did not fail as planned (torchrun's exit code 0" in err
        return
    assert code == 0 and "the job failed as planned (torchrun's exit code 1)" in out
    (command,) = command_after(out, "Which rank failed first, and what every rank held")
    assert command.endswith(f"postmortem {tmp_path / 'failing' / 'memory_records'}"), command


def test_under_a_fit_probe_the_demo_writes_in_fits_folder_not_among_your_runs(demo_script, monkeypatch, tmp_path):
    monkeypatch.setenv("NEMO_MEMLOG_PROBE_DIR", str(tmp_path / "probe-1-mbs-2"))
    cfg = demo_script.load_config([])
    assert cfg.run.root == str(tmp_path / "probe-1-mbs-2" / "runs")
    assert cfg.logger.tensorboard_dir.startswith(str(tmp_path / "probe-1-mbs-2" / "runs"))
    assert demo_script.load_config(["run.root=mine"]).run.root == "mine"  # one you gave stands
