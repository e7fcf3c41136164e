"""The documented API type-checks: mypy (its own API, ``mypy.api.run``) reads a user's script that
imports and uses every documented name (the README's and docs/'s), and finds no error; the same
script with wrong uses finds each, so the names are the real signatures, not ``Any``.

The frameworks and torch are skipped (``follow_imports = skip``: ``Any`` to the checker), as a user
without their stubs has them: what is checked is that nemo_memlog's names resolve and keep their
signatures, in seconds."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]

#: A user's script: every documented name, imported as the docs do and used as they say.
USER_SCRIPT = """
from __future__ import annotations

import torch

import nemo_memlog
from nemo_memlog import (
    DEFAULT_MEMORY_KEYS,
    FlightRecorder,
    GatheredMemory,
    LoggerConfig,
    MemoryMonitor,
    MemoryReduceError,
    build_writers,
    capacity_report,
    close_writers,
    from_overrides,
    gather_memory,
    memory_phase,
    megatron_lm,
    reduce_max_memory_across_pp_group,
    report_memory,
    report_model_state,
    reset_peaks,
    training_log,
)
from nemo_memlog.bridge import MemoryLogCallback as BridgeCallback
from nemo_memlog.lightning import MemoryLogCallback as LightningCallback
from nemo_memlog.megatron_lm import install


def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: torch.distributed.ProcessGroup) -> None:
    config = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=10)
    config = from_overrides(["logger.tensorboard_log_interval=5"], base=config)
    for iteration in range(100):
        with memory_phase("eval", iteration=iteration):
            facts = {"microbatches": 4}
            logged: dict | None = training_log(iteration, config, model=model, optimizer=optimizer, facts=facts)
        if logged is not None:
            loss: float = logged["memory/peak_host_rss_gb"]
    nemo_memlog.close_writers()
    close_writers()
    report: dict[str, int | float] = report_memory(dict(DEFAULT_MEMORY_KEYS))
    report.update(capacity_report())
    report.update(report_model_state(model, optimizer))
    reset_peaks()
    try:
        pipeline_max: dict = reduce_max_memory_across_pp_group(report, group, timeout_s=60.0)
        gathered: GatheredMemory = gather_memory(report, group)
    except MemoryReduceError as error:
        print(error)
    monitor = MemoryMonitor(config, writer_rank=0)
    monitor.log(10, {"loss": 1.0})
    monitor.close()
    writers = build_writers(config)
    writers.log({"loss": 1.0}, 1)
    recorder = FlightRecorder("records", pp_group=group)
    recorder.close()


callback: megatron_lm.MemoryLogCallback = install(memory_reduce_timeout_s=60)
also: megatron_lm.MemoryLogCallback = nemo_memlog.megatron_lm.install()
callbacks = [BridgeCallback(memory_record_dir="off"), LightningCallback(tensorboard_log_interval=5)]
"""

#: Wrong uses, each an error a type checker must find: (the line, what mypy says of it).
WRONG = {
    'nemo_memlog.training_log("ten", LoggerConfig())': 'Argument 1 to "training_log" has incompatible type "str"',
    "count: int = report_memory()": 'Incompatible types in assignment (expression has type "dict[str, int | float]"',
    "install(60)": 'Too many arguments for "install"',
    "BridgeCallback(60)": 'Too many arguments for "MemoryLogCallback"',
    "from nemo_memlog.bridge import NoSuchCallback": 'Module "nemo_memlog.bridge" has no attribute "NoSuchCallback"',
    "nemo_memlog.lightning.MemoryLogCallback().on_train_start()": 'Missing positional arguments "trainer", "pl_module"',
}


def _mypy(tmp_path: Path, script: str) -> tuple[str, int]:
    """mypy's report and exit status on ``script``, nemo_memlog read from this checkout."""
    (tmp_path / "user.py").write_text(script)
    config = tmp_path / "mypy.ini"
    config.write_text(
        textwrap.dedent(
            f"""
            [mypy]
            mypy_path = {ROOT}
            ignore_missing_imports = True
            follow_imports = silent
            cache_dir = {tmp_path / "cache"}
            [mypy-torch.*,lightning.*,pytorch_lightning.*,megatron.*,numpy.*,omegaconf.*]
            follow_imports = skip
            """
        )
    )
    stdout, stderr, status = mypy_api.run(["--config-file", str(config), str(tmp_path / "user.py")])
    return stdout + stderr, status


def test_a_users_script_with_every_documented_name_type_checks(tmp_path):
    report, status = _mypy(tmp_path, USER_SCRIPT)
    assert status == 0, report
    assert "Success: no issues found in 1 source file" in report


def test_wrong_uses_of_the_documented_names_are_each_found(tmp_path):
    lines = [line for line in USER_SCRIPT.splitlines() if not line.startswith(("callback", "also", "callbacks"))]
    report, status = _mypy(tmp_path, "\n".join([*lines, *WRONG]) + "\n")
    assert status == 1
    for line, said in WRONG.items():
        assert said in report, f"mypy did not find: {line}\n{report}"
    assert f"Found {len(WRONG)} errors" in report, report
