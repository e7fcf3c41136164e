"""Notices never raise into training, whatever the warning filters (warn.py): operational ones
(a backend that stops, low headroom, what a backend did not store) are records of the
"nemo_memlog" logger, and misuse, a warning at the caller's line, goes to that log where a filter
would make it an error. Run for real through training_log, under ``-W error`` as
``warnings.simplefilter("error")`` sets it and under pytest's ``filterwarnings = error``."""

import linecache
import logging
import warnings

import pytest
import torch

from nemo_memlog import LoggerConfig, close_writers, training_log
from nemo_memlog.warn import WarnOnce, misuse


def notices(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "nemo_memlog"]


def train_and_log(tmp_path) -> None:
    """Three logging steps of a real model, with a tensorboard_dir that is a file (the backend stops),
    a headroom fraction every machine falls short of, and a metric that is no number (misuse)."""
    (tmp_path / "tb").write_text("not a folder")
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=1,
        tensorboard_dir=str(tmp_path / "tb"),
        writer_mode="thread",
        memory_record_dir=str(tmp_path / "records"),
        memory_headroom_warn_fraction=0.999,
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    for iteration in (1, 2, 3):
        model(torch.randn(4, 8)).square().mean().backward()
        training_log(iteration, cfg, model=model, metrics={"loss": 1.0, "note": "warmup"})
    close_writers()  # the close says what the stopped backend did not store, on the training thread


def check_said(caplog) -> None:
    said = notices(caplog)
    assert len([m for m in said if "this backend stops" in m and "File exists" in m]) == 1, said
    assert len([m for m in said if "tensorboard did not store 3 of the 3 logged steps" in m]) == 1, said
    assert len([m for m in said if "headroom" in m or "close to the OOM killer" in m]) >= 1, said
    # misuse, turned into an error by the filter: said in the log instead of raised
    assert len([m for m in said if "metrics['note']" in m]) == 1, said


def test_under_simplefilter_error_nothing_raises_and_everything_is_said(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nemo_memlog"), warnings.catch_warnings():
        warnings.simplefilter("error")  # what python -W error sets
        train_and_log(tmp_path)
    check_said(caplog)


@pytest.mark.filterwarnings("error")
def test_under_pytests_filterwarnings_error_nothing_raises_and_everything_is_said(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nemo_memlog"):
        train_and_log(tmp_path)
    check_said(caplog)


def an_api_call() -> None:
    misuse("nemo_memlog: a mistake of the caller's")  # stacklevel 2: the line that called an_api_call


def test_misuse_is_a_warning_at_the_callers_line_where_the_filters_allow_it(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        an_api_call()
    assert [str(w.message) for w in caught] == ["nemo_memlog: a mistake of the caller's"]
    assert caught[0].filename == __file__
    assert linecache.getline(__file__, caught[0].lineno).strip() == "an_api_call()"
    assert not notices(caplog)


def test_warn_once_says_each_key_once_with_secrets_scrubbed(caplog):
    warn = WarnOnce("wandb backend: ", ["s3cr3t"])
    with caplog.at_level(logging.WARNING, logger="nemo_memlog"):
        assert warn("k", "token s3cr3t refused") and not warn("k", "again")
    assert notices(caplog) == ["nemo_memlog: wandb backend: token ***redacted*** refused"]
