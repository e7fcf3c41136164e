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

RUN = [sys.executable, "-m", "nemo_memlog.cli", "run"]


def _run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*RUN, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
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
    assert (ran, value, first_finder) == ("yes", "42", "_Finder")
    assert ast.literal_eval(settings) == {"memory_record_dir": "/scratch/records", "memory_reduce_timeout_s": 30}


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


@pytest.fixture
def megatron_lm_loop(monkeypatch):
    """megatron.training.training, its wrapped functions restored after the test, and no install yet."""
    from nemo_memlog.integrations import megatron_lm
    from nemo_memlog.testing import bridge_env, megatron_lm_stand_ins

    if not megatron_lm_stand_ins.has_loop():
        pytest.skip("Megatron-LM's loop ships in megatron-core 0.17+")
    bridge_env.typing_override()
    import megatron.training.training as training

    for name in megatron_lm.WRAPPED:
        monkeypatch.setattr(training, name, getattr(training, name))
    monkeypatch.setattr(megatron_lm, "_installed", {})
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
    assert not megatron_lm._installed


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
