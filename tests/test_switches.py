"""``NEMO_MEMLOG_DISABLED`` read one way (config/switches.py) and honoured where a way in is called
explicitly, not only by ``nemo-memlog run``'s bootstrap: ``training_log`` and the callbacks, in process.
``megatron_lm.install()`` under the switch is in test_megatron_lm.py's in-process notices script."""

from __future__ import annotations

import pytest

from nemo_memlog import LoggerConfig, training_log
from nemo_memlog.config import switches
from nemo_memlog.integrations.autorun import sitecustomize as bootstrap
from nemo_memlog.monitor import training_log as hook
from nemo_memlog.testing.collectives import count_collectives
from nemo_memlog.testing.notices import said

#: Spellings a user may write, each read by the bootstrap and by the package.
WORDS = ["true", "TRUE", " yes ", "on", "1", "false", "False", "0", "no", " off", "", "maybe", "2", "disabled"]


def test_the_package_reads_the_switch_exactly_as_the_bootstrap_does():
    assert (switches.DISABLED_ENV, switches.DISABLED_WAYS_ENV, switches.CPU_STAND_INS_ENV) == (
        bootstrap.DISABLED_ENV,
        bootstrap.DISABLED_WAYS_ENV,
        bootstrap.CPU_STAND_INS_ENV,
    )
    assert (switches.TRUE_WORDS, switches.FALSE_WORDS) == (bootstrap.TRUE_WORDS, bootstrap.FALSE_WORDS)
    for word in WORDS:
        environ = {bootstrap.DISABLED_ENV: word}
        with said():  # the bootstrap says an unreadable value once; the package reads it the same way
            watched, _ = bootstrap.switches(environ)
        assert switches.switched_off(environ) == (watched == {}), word
    assert not switches.switched_off({}) and switches.switched_off({bootstrap.DISABLED_ENV: "maybe"})


class Kept:
    """Writers that keep the steps they are given."""

    def __init__(self):
        self.steps = []

    def log(self, metrics, step):
        self.steps.append(step)

    def flush(self):
        pass

    def close(self):
        pass


class NoGroup:
    """A "group" that fails on any use: a call that touches the group raises."""

    def __getattr__(self, name):
        raise AssertionError(f"the group was touched ({name})")


def test_training_log_under_the_switch_returns_none_and_measures_gathers_and_writes_nothing(monkeypatch, tmp_path):
    import torch

    records = tmp_path / "records"
    config = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=1, memory_record_dir=str(records))
    kept, model, runs = Kept(), torch.nn.Linear(4, 4), hook.open_monitors()
    monkeypatch.setenv(switches.DISABLED_ENV, "true")
    with count_collectives() as calls, said() as caught:
        results = [training_log(i, config, pp_group=NoGroup(), writers=kept, model=model) for i in range(4)]
    assert results == [None] * 4 and kept.steps == [] and list(calls) == [] and list(caught) == []
    assert hook.open_monitors() == runs and not records.exists()  # no run, no flight record
    monkeypatch.setenv(switches.DISABLED_ENV, "false")  # held against the same call with the switch off
    try:
        logged = training_log(0, config, writers=kept, model=model)
        assert logged is not None and kept.steps == [0] and records.exists()
    finally:
        hook.close_writers()


def test_the_callbacks_made_under_the_switch_do_nothing_and_read_no_setting(monkeypatch):
    from nemo_memlog.integrations import lightning, megatron_lm

    monkeypatch.setenv(switches.DISABLED_ENV, "on")
    for callback in (
        megatron_lm.MemoryLogCallback(memory_reduce_timeout_s=-1),  # a setting that cannot work: not read
        lightning.MemoryLogCallback(memory_reduce_timeout_s=-1),
    ):
        assert callback.stopped and callback.monitor is None
        assert callback.on_train_start(None, None) is None and callback.monitor is None  # every event: nothing
    monkeypatch.setenv(switches.DISABLED_ENV, "off")
    with pytest.raises(ValueError, match="memory_reduce_timeout_s"):
        megatron_lm.MemoryLogCallback(memory_reduce_timeout_s=-1)
