"""``nemo-memlog run -- COMMAND``: COMMAND's exit status and signals pass through, the user's own
sitecustomize and PYTHONPATH keep working, settings reach the processes, and each framework's way in
is added on import (Lightning's Trainer here, Bridge's callbacks in-process; Megatron-LM's loop under
torchrun is in test_megatron_lm.py). And ``megatron_lm.install()``: once, or a clear error."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys

import pytest

from nemo_memlog.integrations import instrument
from nemo_memlog.launch.run import BOOTSTRAP

RUN = [sys.executable, "-m", "nemo_memlog.cli", "run"]


def _run(*args: str, env: dict | None = None, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*RUN, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, **kwargs
    )


@pytest.mark.processes
def test_usage_not_found_exit_status_and_signals_are_commands_own():
    usage = _run()
    assert usage.returncode == 2 and "usage: nemo-memlog run" in usage.stderr
    missing = _run("--", "no-such-command-xyz")
    assert missing.returncode == 127 and "no-such-command-xyz: command not found" in missing.stderr
    assert _run("--", "bash", "-c", "exit 7").returncode == 7
    assert _run("--", "bash", "-c", "kill -TERM $$").returncode == -signal.SIGTERM  # the command itself, signalled
    wrong = _run("--set", "memory_recod_dir=/x", "--", "true")
    assert wrong.returncode == 2 and "did you mean 'memory_record_dir'" in wrong.stderr


@pytest.mark.processes
def test_the_users_sitecustomize_and_pythonpath_keep_working_and_settings_reach_the_process(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    (tmp_path / "users_module.py").write_text("VALUE = 42\n")
    probe = (
        "import os, sys, users_module; from nemo_memlog.integrations import instrument; "
        "print(os.environ['USER_SITECUSTOMIZE_RAN'], users_module.VALUE, "
        "type(sys.meta_path[0]).__name__, instrument.settings_from_env())"
    )
    done = _run(
        "--set",
        "memory_record_dir=/scratch/records",
        "--set",
        "logger.memory_reduce_timeout_s=30",
        "--",
        sys.executable,
        "-c",
        probe,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    ran, value, first_finder, settings = done.stdout.split(maxsplit=3)
    assert (ran, value, first_finder) == ("yes", "42", "Watch")
    assert ast.literal_eval(settings) == {"memory_record_dir": "/scratch/records", "memory_reduce_timeout_s": 30}


@pytest.mark.processes
def test_help_lists_what_run_and_every_command_do():
    for flag in ("--help", "-h"):
        done = _run(flag)
        assert done.returncode == 0 and done.stdout.startswith("usage: nemo-memlog run"), done.stderr
        assert "NEMO_MEMLOG_DISABLED" in done.stdout and "--cpu" in done.stdout
    top = subprocess.run([*RUN[:-1], "--help"], capture_output=True, text=True, timeout=60)
    description = top.stdout.split("positional arguments")[0]
    assert top.returncode == 0 and all(
        f"{command} " in description for command in ("report", "postmortem", "advise", "fit", "run")
    )


@pytest.mark.processes
def test_a_bad_setting_is_refused_at_launch_naming_it_before_the_command_starts(tmp_path):
    started = tmp_path / "started"
    for setting, env, says in [
        ("memory_reduce_timeout_s=-1", {}, "--set memory_reduce_timeout_s: logger.memory_reduce_timeout_s must be"),
        ("memory_peak_window=forever", {}, "one of 'run', 'interval'"),
        ("memory_headroom_warn_fraction=NaN", {}, "a finite number"),
        ("logger.memory_reduce_stall_warn_s=1e999", {}, "a finite number"),
        (
            None,
            {"NEMO_MEMLOG_MEMORY_KEYS": "[" * 100_000},
            "NEMO_MEMLOG_MEMORY_KEYS: logger.memory_keys must be a JSON",
        ),
        ("tensorboard_dir=/runs/tb", {}, "--set tensorboard_dir: no way in takes it from run"),
        (None, {"NEMO_MEMLOG_WANDB_PROJECT": "p"}, "NEMO_MEMLOG_WANDB_PROJECT: no way in takes it from run"),
        (
            None,
            {"NEMO_MEMLOG_DISABLED_INTEGRATIONS": "lightnin"},
            "'lightnin' is no way in (did you mean 'lightning'?)",
        ),
    ]:
        done = _run(*(["--set", setting] if setting else []), "--", "touch", str(started), env=env)
        assert done.returncode == 2 and says in done.stderr, (setting, env.keys(), done.stderr[-500:])
        assert "Traceback" not in done.stderr and len(done.stderr) < 2000
    assert not started.exists()


@pytest.mark.processes
def test_the_environment_is_kept_exactly(tmp_path):
    """PYTHONPATH's entries after ours, empty ones too (the working folder); a path setting stays a
    string; what the user's sitecustomize changes in the launcher (a Python process too) is not passed on."""
    (tmp_path / "in_working_folder.py").write_text("VALUE = 'found'\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nos.environ['STARTS'] = os.environ.get('STARTS', '') + 'x'\n"  # would double through the launcher
    )
    user_path = f"{site}{os.pathsep}{os.pathsep}/nonexistent"
    probe = (
        "import os, in_working_folder; from nemo_memlog.integrations import instrument; "
        "print(os.environ['PYTHONPATH'], os.environ['STARTS'], in_working_folder.VALUE, instrument.settings_from_env())"
    )
    command = [sys.executable, "-c", probe]
    done = _run("--set", "memory_record_dir=2024", "--", *command, env={"PYTHONPATH": user_path}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    path, starts, found, settings = done.stdout.split(maxsplit=3)
    assert path == os.pathsep.join([str(BOOTSTRAP), user_path]) and (starts, found) == ("x", "found")
    assert ast.literal_eval(settings) == {"memory_record_dir": "2024"}  # the folder "2024", not the int


@pytest.mark.processes
def test_what_run_prints_carries_no_secret():
    secret = "hunter2-tracking-token"
    banner = _run("--", "env", f"WANDB_API_KEY={secret}", "true", env={"MLFLOW_TRACKING_PASSWORD": "pw-of-the-env"})
    assert banner.returncode == 0 and "memory logging added to every Python process of: env" in banner.stderr
    assert secret not in banner.stderr
    long = _run("--", "true", "x" * 10_000)
    assert long.returncode == 0 and len(long.stderr) <= 200
    usage = _run("--set", f"wandb_api_key={secret}", "--", "true")
    assert usage.returncode == 2 and "wandb_api_key" in usage.stderr and secret not in usage.stderr
    shell = _run("--", "sh", "-c", f"true --comet-api-key={secret}")
    assert shell.returncode == 0 and secret not in shell.stderr


@pytest.mark.processes
def test_closed_or_full_stdout_and_stderr_do_not_stop_the_command(tmp_path):
    launch = " ".join([*RUN, "--", "touch"])
    for redirect, marker in [(">&- 2>&-", "closed"), (">/dev/full 2>/dev/full", "full")]:
        done = subprocess.run(["bash", "-c", f"{launch} {tmp_path / marker} {redirect}"], timeout=60)
        assert done.returncode == 0 and (tmp_path / marker).exists(), marker


@pytest.mark.processes
def test_a_command_that_cannot_start_is_one_line_126_or_127(tmp_path):
    script = tmp_path / "no_shebang.sh"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    too_long = (  # one argument past the kernel's 128 KiB per string: the launcher's exec gets E2BIG
        "import sys; from nemo_memlog.launch import run; sys.exit(run.main(['--', 'true', 'x' * 200_000]))"
    )
    for command, status, says in [
        ([str(script)], 126, "run it with its interpreter (nemo-memlog run -- bash"),
        ([str(tmp_path / "loop_a")], 126, "cannot run it (Too many levels of symbolic links)"),
        ([str(plain)], 126, "cannot run it (Permission denied)"),
        ([str(tmp_path / "absent")], 127, "no such file"),
    ]:
        done = _run("--", *command)
        assert done.returncode == status and says in done.stderr, done.stderr
        assert done.stderr.count("\n") == 2 and "Traceback" not in done.stderr  # the banner, then one line
    e2big = subprocess.run([sys.executable, "-c", too_long], capture_output=True, text=True, timeout=60)
    assert e2big.returncode == 126 and "too long for the system" in e2big.stderr and "Traceback" not in e2big.stderr


@pytest.mark.processes
def test_a_lightning_trainer_gets_the_callback_once():
    probe = (
        "import lightning.pytorch as L; from nemo_memlog.lightning import MemoryLogCallback as C; "
        "t = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False); "
        "u = L.Trainer(logger=False, enable_checkpointing=False, callbacks=[C(log_memory_to_tensorboard=False)]); "
        "print(sum(isinstance(c, C) for c in t.callbacks), sum(isinstance(c, C) for c in u.callbacks))"
    )
    done = _run("--", sys.executable, "-c", probe, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]  # added to the first; the second's own is kept, none added


@pytest.mark.processes  # importing megatron-core runs git for its version
def test_bridge_callbacks_get_ours_unless_present():
    from nemo_memlog.testing import bridge_env

    bridge_env.load()
    from megatron.bridge.training.callbacks import CallbackManager

    from nemo_memlog.bridge import MemoryLogCallback

    added = instrument.with_bridge_callback(None)
    assert [type(c) for c in added] == [MemoryLogCallback]
    own = MemoryLogCallback()
    assert instrument.with_bridge_callback([own]) == [own]
    manager = CallbackManager()
    manager.add(own)
    assert instrument.with_bridge_callback(manager) is manager
    assert len(manager.list_callbacks("on_train_start")) == 1
    empty = CallbackManager()
    instrument.with_bridge_callback(empty)
    assert [type(f.__self__) for f in empty.list_callbacks("on_train_start")] == [MemoryLogCallback]
    from nemo_memlog.integrations import bridge, lightning, megatron_lm
    from nemo_memlog.launch import run

    # run refuses at launch only what no way in takes: its table is theirs (it imports none of them)
    assert run.TAKEN_BY == {
        "megatron_lm": megatron_lm.OWN_SETTINGS,
        "bridge": bridge.OWN_SETTINGS,
        "lightning": lightning.SETTINGS,
    }


@pytest.fixture
def megatron_lm_loop(monkeypatch):
    """megatron.training.training, its wrapped functions restored after the test, and no install yet."""
    from nemo_memlog.integrations import megatron_lm
    from nemo_memlog.testing import bridge_env
    from nemo_memlog.testing.megatron import lm_stand_ins as megatron_lm_stand_ins

    if not megatron_lm_stand_ins.has_loop():
        pytest.skip("Megatron-LM's loop ships in megatron-core 0.17+")
    bridge_env.typing_override()
    import megatron.training.training as training

    for name in megatron_lm.WRAPPED:
        monkeypatch.setattr(training, name, getattr(training, name))
    monkeypatch.delattr(training, megatron_lm.MARK, raising=False)  # no install yet (restored after)
    return training


@pytest.mark.processes  # importing megatron-core runs git for its version
def test_install_twice_installs_once(megatron_lm_loop):
    from nemo_memlog import megatron_lm

    original = megatron_lm_loop.training_log
    first = megatron_lm.install(memory_reduce_timeout_s=30)
    assert megatron_lm.install() is first
    assert megatron_lm_loop.training_log.__wrapped__ is original  # one wrapper, over Megatron-LM's own
    with pytest.raises(ValueError, match="unknown setting.*tensorboard_dir"):
        megatron_lm.MemoryLogCallback(tensorboard_dir="/x")


@pytest.mark.processes
def test_a_loop_without_what_install_wraps_is_named_with_the_version(megatron_lm_loop, monkeypatch):
    from importlib.metadata import version

    from nemo_memlog import megatron_lm

    monkeypatch.delattr(megatron_lm_loop, "train_step")  # a release that renamed it: provoked, none exists yet
    with pytest.raises(
        megatron_lm.MegatronLMError, match=f"train_step is missing in megatron-core {version('megatron-core')}"
    ):
        megatron_lm.install()
    assert not hasattr(megatron_lm_loop, megatron_lm.MARK)


def test_mem_series_are_the_pipelines_max_in_megatron_lms_units():
    from nemo_memlog.integrations.megatron_lm import megatron_lm_series

    logged = {
        "memory/current_reserved_gb": 3.221225472,
        "memory/current_allocated_gb": 1.5,
        "memory/peak_allocated_gb": 2.000000001,
        "memory/current_allocation_count": 812,
    }
    assert megatron_lm_series(logged) == {
        "mem-reserved-bytes": 3221225472,
        "mem-allocated-bytes": 1500000000,
        "mem-max-allocated-bytes": 2000000001,
        "mem-allocated-count": 812,
    }
    assert megatron_lm_series({"memory/peak_host_rss_gb": 1.0}) == {}  # no device statistics: none written
    assert megatron_lm_series({"memory/current_reserved_gb": float("nan")}) == {}
