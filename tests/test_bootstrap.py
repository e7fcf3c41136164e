"""``nemo-memlog run``'s bootstrap (integrations/autorun/sitecustomize.py) in real Python processes, the
folder on PYTHONPATH as ``run`` puts it: the user's own sitecustomize runs once as itself, any number
of copies activate once, nothing of ours loads until a framework does, the switches, and whatever goes
wrong in a way in is one notice while the program runs on. The frameworks here are stand-in modules
of the watched names (a real import of each is in test_run.py and test_megatron_lm.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_memlog.config import TextError, field_from_text, fields_from_text
from nemo_memlog.integrations.autorun import sitecustomize as bootstrap
from nemo_memlog.launch.run import BOOTSTRAP

pytestmark = pytest.mark.processes

#: What a process reports: its sitecustomize, the hook, what of ours it loaded.
PROBE = (
    "import sys; sc = sys.modules.get('sitecustomize'); "
    "print(getattr(sc, '__name__', None), getattr(sc, 'USERS', None), "
    "sum(type(f).__name__ == 'Watch' for f in sys.meta_path), "
    "sorted(m for m in sys.modules if m.startswith('nemo_memlog')))"
)


def _python(code: str, *path: Path | str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` with ``path`` as PYTHONPATH, the rest of this environment's NEMO_MEMLOG_* unset."""
    base = {key: value for key, value in os.environ.items() if not key.startswith("NEMO_MEMLOG_")}
    base["PYTHONPATH"] = os.pathsep.join(map(str, path))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def users(tmp_path):
    """A user's sitecustomize (a module) that counts its runs in a file, and a package-style one with a
    relative import; each sets USERS."""
    module = tmp_path / "module"
    module.mkdir()
    (module / "sitecustomize.py").write_text(
        "import os\nUSERS = 'module'\nwith open(os.environ['RUNS'], 'a') as f:\n    f.write('ran\\n')\n"
    )
    package = tmp_path / "package" / "sitecustomize"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .helper import NAME as USERS\n")
    (package / "helper.py").write_text("NAME = 'package'\n")
    return tmp_path


def test_nothing_of_ours_loads_where_no_framework_is_imported(tmp_path):
    done = _python(PROBE, BOOTSTRAP, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split(maxsplit=3) == [
        "sitecustomize",
        "None",
        "1",
        "[]",
    ]  # ours; the hook; no nemo_memlog
    assert done.stderr == ""


def test_the_users_sitecustomize_runs_once_as_itself_behind_any_number_of_copies(users, tmp_path):
    copy = shutil.copytree(BOOTSTRAP, tmp_path / "copy")  # a second install
    (tmp_path / "link").symlink_to(BOOTSTRAP)  # a symlink to the folder
    runs = tmp_path / "runs.txt"
    path = (BOOTSTRAP, tmp_path / "link", copy, users / "module")
    done = _python(PROBE, *path, cwd=tmp_path, env={"RUNS": str(runs)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split(maxsplit=3) == ["sitecustomize", "module", "1", "[]"]  # the user's, one hook
    assert runs.read_text() == "ran\n"  # once
    assert "Error" not in done.stderr and "Recursion" not in done.stderr
    package = _python(PROBE, BOOTSTRAP, copy, users / "package", cwd=tmp_path)
    assert package.stdout.strip().split(maxsplit=3) == ["sitecustomize", "package", "1", "[]"], package.stderr


def test_an_error_in_the_users_sitecustomize_shows_as_python_shows_it_and_the_hook_is_installed(tmp_path):
    failing = tmp_path / "failing"
    failing.mkdir()
    (failing / "sitecustomize.py").write_text("raise ValueError('the user s own error')\n")
    without = _python("print('ran')", failing, cwd=tmp_path)
    with_us = _python(PROBE, BOOTSTRAP, failing, cwd=tmp_path)
    assert without.stderr.startswith("Error in sitecustomize; set PYTHONVERBOSE for traceback:\nValueError: the user")
    assert with_us.stderr == without.stderr  # word for word, as Python shows it
    assert with_us.returncode == 0 and with_us.stdout.split()[2] == "1"  # our hook all the same


def test_the_switches(users, tmp_path):
    runs = tmp_path / "runs.txt"
    off = _python(
        PROBE, BOOTSTRAP, users / "module", cwd=tmp_path, env={"RUNS": str(runs), "NEMO_MEMLOG_DISABLED": "true"}
    )
    assert off.stdout.strip().split(maxsplit=3)[1:3] == ["module", "0"]  # the user's runs; no hook
    watched = (
        "import sys; watch = next(f for f in sys.meta_path if type(f).__name__ == 'Watch'); "
        "print(sorted(set(watch.watched.values())))"
    )
    some = _python(watched, BOOTSTRAP, cwd=tmp_path, env={"NEMO_MEMLOG_DISABLED_INTEGRATIONS": "Lightning, bridge"})
    assert some.stdout.strip() == "['megatron_lm']", some.stderr
    bad = _python(watched, BOOTSTRAP, cwd=tmp_path, env={"NEMO_MEMLOG_DISABLED_INTEGRATIONS": "lightnin"})
    assert bad.stdout.strip() == "['bridge', 'lightning', 'megatron_lm']"
    assert bad.stderr.count("nemo_memlog:") == 1 and "lightnin, which is no way in" in bad.stderr
    garbled = _python(PROBE, BOOTSTRAP, cwd=tmp_path, env={"NEMO_MEMLOG_DISABLED": "maybe"})
    assert garbled.stdout.split()[2] == "0" and garbled.stderr.count("nemo_memlog:") == 1  # off, said once


@pytest.fixture
def frameworks(tmp_path):
    """Stand-ins of two watched modules: Megatron-LM's loop (plain, importing typing.override as
    megatron-core 0.17+ does) and a Lightning whose trainer module lacks Trainer (a way in that fails)."""
    root = tmp_path / "frameworks"
    loop = root / "megatron" / "training"
    loop.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (root / "megatron" / "core").mkdir()
    (root / "megatron" / "core" / "__init__.py").write_text("from typing import override\n")
    (loop / "__init__.py").write_text("")
    (loop / "training.py").write_text("def pretrain():\n    return 'trained'\n")
    trainer = root / "lightning" / "pytorch" / "trainer"
    trainer.mkdir(parents=True)
    for folder in (root / "lightning", root / "lightning" / "pytorch", trainer):
        (folder / "__init__.py").write_text("")
    (trainer / "trainer.py").write_text("NOT_A_TRAINER = 1\n")
    return root


def test_what_fails_in_a_way_in_is_one_notice_and_the_program_runs_on(frameworks, tmp_path):
    deep = "{" * 100_000  # set by hand, not through run (which refuses it at launch)
    code = (
        "import lightning.pytorch.trainer.trainer, megatron.training.training as t; "
        "import lightning.pytorch.trainer.trainer; print(t.pretrain())"
    )
    done = _python(code, BOOTSTRAP, frameworks, cwd=tmp_path, env={"NEMO_MEMLOG_MEMORY_KEYS": deep})
    assert done.returncode == 0 and done.stdout == "trained\n", done.stderr
    notices = [line for line in done.stderr.splitlines() if line.startswith("nemo_memlog:")]
    assert notices == [
        "nemo_memlog: NEMO_MEMLOG_MEMORY_KEYS: logger.memory_keys must be a JSON object of strings, e.g. "
        '{"allocated_bytes.all.current": "current_allocated_gb"} (empty: None); got '
        f"{deep[:40]!r}... (100000 characters); this process runs without memory logging"
    ]  # one, for both ways in
    lightning = _python("import lightning.pytorch.trainer.trainer; print('ran')", BOOTSTRAP, frameworks, cwd=tmp_path)
    assert lightning.stdout == "ran\n"
    assert lightning.stderr.startswith("nemo_memlog: could not instrument lightning.pytorch.trainer.trainer (")
    assert lightning.stderr.count("\n") == 1


def test_the_cpu_switch_gives_megatron_core_python_3_12_s_typing_override(frameworks, tmp_path):
    if sys.version_info >= (3, 12):
        pytest.skip("typing.override is there")
    without = _python("import megatron.core", BOOTSTRAP, frameworks, cwd=tmp_path)
    assert "cannot import name 'override'" in without.stderr  # what the switch's first stand-in is for
    switched = _python(
        "import megatron.core", BOOTSTRAP, frameworks, cwd=tmp_path, env={"NEMO_MEMLOG_CPU_STAND_INS": "1"}
    )
    assert (switched.returncode, switched.stderr) == (0, "")


def test_settings_are_typed_by_the_fields_declared_type():
    assert fields_from_text({"memory_record_dir": "2024"}) == {"memory_record_dir": "2024"}  # a folder
    assert fields_from_text({"memory_reduce_timeout_s": "30", "log_memory_to_tensorboard": "on"}) == {
        "memory_reduce_timeout_s": 30.0,
        "log_memory_to_tensorboard": True,
    }
    assert field_from_text("memory_per_stage_keys", "peak_*, device_used_gb") == ["peak_*", "device_used_gb"]
    assert field_from_text("memory_record_dir", "") is None
    for name, text, says in [
        ("memory_reduce_timeout_s", "-1", "positive number of seconds"),
        ("memory_reduce_timeout_s", "1e999", "finite number"),
        ("memory_headroom_warn_fraction", "NaN", "finite number"),
        ("memory_peak_window", "forever", "'run', 'interval'"),
        ("tensorboard_log_interval", "10.5", "whole number"),
        ("memory_keys", "[" * 100_000, "JSON object"),
        ("memory_keys", '{"a": 1}', "JSON object of strings"),
        ("comet_api_key", "", None),
    ]:
        if says is None:
            assert field_from_text(name, text) is None
            continue
        with pytest.raises(TextError, match=f"logger.{name} must be .*") as refused:
            fields_from_text({name: text})
        assert says in str(refused.value) and refused.value.field == name


def test_the_bootstraps_tables_name_the_ways_in_that_instrument_adds():
    from nemo_memlog.integrations import instrument
    from nemo_memlog.launch import run

    assert set(bootstrap.WATCHED.values()) == set(instrument.WAYS_IN) == set(run.WAYS_IN)
    assert (bootstrap.DISABLED_ENV, bootstrap.DISABLED_WAYS_ENV, bootstrap.CPU_STAND_INS_ENV) == (
        run.DISABLED_ENV,
        run.DISABLED_WAYS_ENV,
        run.CPU_STAND_INS_ENV,
    )
    assert bootstrap.MARK in (BOOTSTRAP / "sitecustomize.py").read_bytes().splitlines()[0]
