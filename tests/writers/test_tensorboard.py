"""TensorBoard writer: write one real run, read it back with TensorBoard's own reader."""

import math
from pathlib import Path

import pytest

from nemo_memlog.config import REDACTED, LoggerConfig, flat_params, secrets_of
from nemo_memlog.writers import tensorboard
from tests.writers.sample import LACKING_FIELDS, SECRET, STEPS, write_steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    cfg = LoggerConfig(tensorboard_dir=str(root / "tb"), comet_api_key=SECRET)
    assert tensorboard.enabled(cfg)
    backend = tensorboard.open_backend(cfg, flat_params(cfg), secrets_of(cfg))
    write_steps(backend)
    backend.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return root, EventAccumulator(str(root / "tb")).Reload()


def test_enabled_only_with_a_directory():
    assert not tensorboard.enabled(LoggerConfig())
    assert not tensorboard.enabled(LACKING_FIELDS)  # objects lacking the field: our default (None)


def test_every_metric_reads_back_at_its_step(run):
    _, events = run
    for key in STEPS[10]:
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [10, 20]
        for scalar, step in zip(scalars, STEPS):
            expected = STEPS[step][key]
            if math.isnan(expected):
                assert math.isnan(scalar.value)
            else:
                assert scalar.value == expected  # exact: every test value fits a float32


def test_ints_come_back_as_floats(run):
    _, events = run
    assert [s.value for s in events.Scalars("memory/alloc_retries")] == [7.0, 8.0]


def test_config_is_recorded_once_redacted(run):
    root, _ = run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = EventAccumulator(str(root / "tb"), size_guidance={"tensors": 0}).Reload()
    records = texts.Tensors("config/text_summary")
    assert len(records) == 1
    text = records[0].tensor_proto.string_val[0].decode()
    assert "tensorboard_dir" in text and REDACTED in text


def test_secret_is_written_nowhere(run):
    root, _ = run
    files = [p for p in Path(root).rglob("*") if p.is_file()]
    assert files
    assert [p for p in files if SECRET.encode() in p.read_bytes()] == []


# Stage runs and the custom-scalars layout over them: tests/writers/test_stages.py.
