"""Writing into loggers someone else opened (a framework such as Megatron-Bridge):
``adopt_writers`` recognises each real logger object, writes into it on the calling
thread, flushes it and never closes it. Comet here (Bridge >= 0.5 opens a
``comet_ml.Experiment``); TensorBoard, W&B and MLflow are read back in tests/test_bridge.py,
inside Megatron-Bridge's own loggers."""

from nemo_memlog.testing.notices import said
from nemo_memlog.writers import adopt_writers, comet
from tests.readback import read_archive
from tests.writers.sample import STEPS, write_steps


def test_a_comet_experiment_opened_elsewhere_gets_every_step_and_stays_open(tmp_path):
    comet_ml = comet.import_comet_ml()
    experiment = comet_ml.OfflineExperiment(
        offline_directory=str(tmp_path), project_name="bridge-run", **comet.NO_CAPTURE
    )
    writers = adopt_writers([None, object(), "not a logger", experiment])
    assert writers.backend_names == ["comet"], "only the experiment is recognised; None and strangers are skipped"
    write_steps(writers)
    writers.close()  # ours to flush, the opener's to end
    assert experiment.alive, "close() must not end an experiment it did not open"
    experiment.log_metric("opener's own", 1.0, step=30)  # the opener still writes after us
    experiment.end()
    (archive,) = tmp_path.glob("*.zip")
    _, messages = read_archive(archive)
    logged = {}
    for message in messages:
        metric = (message.get("payload") or {}).get("metric") or message.get("metric")
        if isinstance(metric, dict):
            logged.setdefault(metric["metricName"], []).append((metric.get("step"), metric["metricValue"]))
    for step, metrics in STEPS.items():
        assert (step, 3.5 if step == 10 else 4.0) in logged["memory/peak_allocated_gb"]
        assert (step, metrics["memory/alloc_retries"]) in logged["memory/alloc_retries"]
    assert (30, 1.0) in logged["opener's own"]


class Broken:
    """A logger object of a known kind that fails, as a dead connection would."""

    __module__ = "torch.utils.tensorboard.writer"

    def add_scalar(self, *args):
        raise ConnectionError("the disk went away")

    def flush(self):
        raise ConnectionError("the disk went away")


def test_a_failing_adopted_logger_is_isolated_and_warned_once(tmp_path):
    comet_ml = comet.import_comet_ml()
    experiment = comet_ml.OfflineExperiment(
        offline_directory=str(tmp_path), project_name="bridge-run", **comet.NO_CAPTURE
    )
    writers = adopt_writers([Broken(), experiment])
    assert writers.backend_names == ["tensorboard", "comet"]
    with said(warned=False) as caught:
        for step, metrics in STEPS.items():
            writers.log(metrics, step)  # never raises into training
    experiment.end()
    failures = [w for w in caught if "tensorboard backend: log failed" in w]
    assert len(failures) == 1 and "ConnectionError" in failures[0], [w for w in caught]
    assert writers.failures == {"tensorboard": 2}
    (archive,) = tmp_path.glob("*.zip")
    _, messages = read_archive(archive)
    assert "memory/peak_allocated_gb" in str(messages), "the healthy backend still got every step"


def test_an_adopted_summarywriter_given_the_run_config_records_it_once_and_report_reads_the_peak_window(tmp_path):
    """Megatron-LM and Bridge write into their own SummaryWriter: its events hold our run config only as
    ``adopt_writers(config=...)`` records it (Bridge's case here: the run config is the run's Settings;
    Megatron-LM's, a dict of its args, is read back in tests/test_megatron_lm.py)."""
    from torch.utils.tensorboard import SummaryWriter

    from nemo_memlog.config import resolve_fields
    from nemo_memlog.offline import events, report

    settings = resolve_fields(log_memory_to_tensorboard=True, memory_peak_window="interval")
    writer = SummaryWriter(str(tmp_path))
    writers = adopt_writers([writer], config=settings, run_config={**vars(settings), "wandb_api_key": "k-secret-1"})
    write_steps(writers)
    writers.close()
    writer.close()
    run = events.load_run(tmp_path)
    assert report.peak_window_line(run).startswith("peak window: interval (")
    text = b"".join(path.read_bytes() for path in tmp_path.glob("events.out.tfevents.*"))
    assert text.count(b"config/text_summary") == 1 and b"k-secret-1" not in text
