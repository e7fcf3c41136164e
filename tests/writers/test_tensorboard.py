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


def test_our_runs_hold_the_events_torchs_summarywriter_writes_for_the_same_calls(tmp_path):
    """The writer writes its runs with the tensorboard package alone (no torch in the writer process):
    held against torch's own SummaryWriter given the same calls, event for event, wall times aside."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    layout = tensorboard.layout(["memory/peak_reserved_gb", "memory/weird key*(1)"])

    def calls(writer):
        writer.add_text("config", '    {\n      "a": 1\n    }', 0)
        for step, value in [(1, 0.5), (2, 1.25), (3, float("inf")), (4, float("nan")), (5, 7)]:
            writer.add_scalar("memory/peak_reserved_gb", value, step)
        writer.add_custom_scalars(layout)
        writer.flush()
        writer.add_scalar("memory/weird key*(1)", 2.0, 6)
        writer.close()

    calls(tensorboard.EventWriter(str(tmp_path / "ours"), max_queue=3))
    calls(SummaryWriter(log_dir=str(tmp_path / "torch"), max_queue=3))

    def events(folder):
        (path,) = (tmp_path / folder).glob("events.out.tfevents.*")
        found = []
        for event in EventFileLoader(str(path)).Load():
            event.wall_time = 0
            found.append(event.SerializeToString())
        return found

    ours, torchs = events("ours"), events("torch")
    assert len(ours) == 9 and ours == torchs
