"""LoggerConfig: Megatron-Bridge field names, dotted overrides, clear errors, redaction."""

import pytest

from nemo_memlog.config import REDACTED, LoggerConfig, flat_params, from_overrides, recorded_params, secrets_of


def test_dotted_overrides_as_recipes_pass_them():
    cfg = from_overrides(
        [
            "logger.log_memory_to_tensorboard=true",
            "logger.tensorboard_log_interval=10",
            "train.iters=5",
            "logger.mlflow_tags={team: llm}",
            "logger.memory_reduce_scope=world",
            "logger.memory_peak_window=interval",
        ]
    )
    assert cfg.log_memory_to_tensorboard is True and cfg.tensorboard_log_interval == 10
    assert cfg.mlflow_tags == {"team": "llm"} and cfg.memory_reduce_scope == "world"
    assert cfg.memory_peak_window == "interval" and LoggerConfig().memory_peak_window == "run"


@pytest.mark.parametrize(
    "override, message",
    [
        ("logger.tensorboard_log_interval=0", "tensorboard_log_interval must be an int >= 1"),
        ("logger.tensorboard_log_interval=-3", "tensorboard_log_interval must be an int >= 1"),
        ("logger.mlflow_experiment=x", "mlflow_run_name is not: set both"),
        ("logger.memory_reduce_scope=node", "must be 'pp' or 'world'"),
        ("logger.memory_reduce_timeout_s=0", "positive number of seconds"),
        ("logger.writer_buffer_steps=0", "writer_buffer_steps must be an int >= 1"),
        ("logger.memory_peak_window=step", "memory_peak_window must be one of 'run', 'interval'"),
        ("logger.writer_mode=fork", "writer_mode must be one of 'process', 'thread'; got 'fork'"),
        ("logger.no_such_field=1", "Known logger fields"),
    ],
)
def test_bad_settings_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        from_overrides([override])


def test_secrets_are_redacted_everywhere_a_config_is_shown():
    cfg = LoggerConfig(comet_api_key="TOP-SECRET", mlflow_tags={"auth_token": "TOKEN-2", "team": "llm"})
    assert "TOP-SECRET" not in repr(cfg)
    params = flat_params(cfg)
    assert params["comet_api_key"] == REDACTED and params["mlflow_tags.auth_token"] == REDACTED
    assert params["mlflow_tags.team"] == "llm"
    assert sorted(secrets_of(cfg)) == ["TOKEN-2", "TOP-SECRET"]


def test_the_peak_window_is_recorded_also_for_a_config_without_the_field():
    class BridgeLogger:  # Megatron-Bridge's LoggerConfig has no memory_peak_window field
        log_memory_to_tensorboard = True

    class Container:
        logger = BridgeLogger()

    assert recorded_params(Container(), Container.logger)["logger.memory_peak_window"] == "run"
    Container.logger.memory_peak_window = "interval"  # set on the object: used, and recorded
    assert recorded_params(Container(), Container.logger)["logger.memory_peak_window"] == "interval"
    cfg = LoggerConfig(memory_peak_window="interval")
    assert recorded_params(cfg, cfg) == flat_params(cfg)  # already there: nothing added


def test_an_unknown_field_names_the_closest_one():
    with pytest.raises(
        TypeError, match=r"no field 'tensorboard_log_intervall' \(did you mean 'tensorboard_log_interval'\?\)"
    ):
        LoggerConfig(tensorboard_log_intervall=1)
    with pytest.raises(ValueError, match=r"no field 'memory_peak_windw' \(did you mean 'memory_peak_window'\?\)"):
        from_overrides(["logger.memory_peak_windw=interval"])


@pytest.mark.parametrize("argument", ["/tmp/out", "--lr=0.1", "-v", "out_dir", "epochs=3"])
def test_a_script_argument_that_is_no_override_shows_the_expected_form(argument):
    # from_overrides(sys.argv[1:]) in a script with arguments of its own.
    with pytest.raises(ValueError, match=f"{argument!r}.*expected logger.key=value"):
        from_overrides(["logger.log_memory_to_tensorboard=true", argument])


def test_other_sections_and_the_bare_field_form_are_still_taken():
    cfg = from_overrides(
        ["train.iters=5", "model.hidden=3", "tensorboard_log_interval=4", "logger.mlflow_tags.team=llm"]
    )
    assert cfg.tensorboard_log_interval == 4 and cfg.mlflow_tags == {"team": "llm"}
