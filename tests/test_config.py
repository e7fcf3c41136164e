"""LoggerConfig: Megatron-Bridge field names, dotted overrides, clear errors, redaction."""

import math

import pytest

from nemo_memlog.config import REDACTED, LoggerConfig, flat_params, from_overrides, recorded, secrets_of


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

    assert recorded(Container(), Container.logger)[0]["logger.memory_peak_window"] == "run"
    Container.logger.memory_peak_window = "interval"  # set on the object: used, and recorded
    assert recorded(Container(), Container.logger)[0]["logger.memory_peak_window"] == "interval"
    cfg = LoggerConfig(memory_peak_window="interval")
    assert recorded(cfg, cfg)[0] == flat_params(cfg)  # already there: nothing added


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


# Issue 33: every field's type is checked where the config is read, in one place, with one message.


@pytest.mark.parametrize(
    "field, value, takes",
    [
        ("log_memory_to_tensorboard", "false", "true or false (a bool: True or False)"),
        ("log_memory_to_tensorboard", 1, "true or false (a bool: True or False)"),
        ("memory_record_history", "yes", "true or false"),
        ("tensorboard_dir", 123, "a path string or None"),
        ("wandb_project", 7, "a string or None"),
        ("tensorboard_log_interval", "10", "an int >= 1"),
        ("tensorboard_log_interval", True, "an int >= 1"),
        ("tensorboard_queue_size", 1.5, "an int"),
        ("memory_headroom_warn_fraction", True, "a number in [0, 1)"),
        ("memory_reduce_timeout_s", "30", "a positive number of seconds"),
        ("memory_per_stage_keys", "peak_*", "a list of name patterns (strings)"),
        ("comet_tags", ["a", 2], "a list of strings or None"),
        ("mlflow_tags", ["team"], "a dict or None"),
        ("memory_keys", "allocated_bytes.all.peak", "a dict of torch.cuda.memory_stats() names"),
        ("memory_reduce_scope", 1, "'pp' or 'world'"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field_the_value_and_what_to_write(field, value, takes):
    with pytest.raises(ValueError) as raised:
        LoggerConfig(**{"log_memory_to_tensorboard": True, field: value})
    message = str(raised.value)  # one shape: logger.<field> must be <what to write>; got <value> (<type>)
    assert message.startswith(f"logger.{field} must be {takes}"), message
    assert message.endswith(f"; got {value!r} ({type(value).__name__})"), message


def test_a_secret_of_the_wrong_type_is_named_without_its_value():
    with pytest.raises(ValueError, match=r"^logger.comet_api_key must be a string or None; got a value of type int$"):
        LoggerConfig(comet_api_key=987654321)


def test_every_field_has_a_type_rule_and_the_values_it_was_made_for_pass():
    from pathlib import Path

    from omegaconf import OmegaConf

    from nemo_memlog.config import check_logger_fields, resolve

    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_dir=Path("runs/tb"),  # a path object
        memory_headroom_warn_fraction=0,  # an int where a float is declared
        memory_reduce_timeout_s=5,
        comet_tags=("a", "b"),
        memory_per_stage_keys=OmegaConf.create(["peak_*"]),  # from a YAML recipe
        mlflow_tags=OmegaConf.create({"team": "llm"}),
    )
    check_logger_fields(resolve(cfg))  # the resolved settings (tuples) pass too
    assert resolve(cfg).log_memory_to_tensorboard is True


class BridgeStyleLogger:
    """Megatron-Bridge's LoggerConfig as nemo_memlog reads it: the shared names, with fields of its
    own, of its own types, that nemo_memlog does not read (and so does not check)."""

    def __init__(self, **fields):
        self.log_memory_to_tensorboard = False
        self.tensorboard_log_interval = 1
        self.tensorboard_dir = None
        self.timing_log_level = 0  # Bridge's own: Literal[-1, 0, 1, 2]
        self.logging_level = None  # int | None
        self.profile_ranks = [0]
        self.log_interval = "not ours"  # a value of a type nemo_memlog would refuse, in a field it never reads
        vars(self).update(fields)


class BridgeStyleContainer:
    def __init__(self, logger):
        self.logger = logger
        self.train = object()


@pytest.mark.parametrize("wrap", [lambda logger: logger, BridgeStyleContainer], ids=["logger", "container"])
def test_config_like_objects_are_checked_on_the_fields_nemo_memlog_reads_only(wrap):
    from nemo_memlog import training_log
    from nemo_memlog.config import resolve

    assert resolve(wrap(BridgeStyleLogger(log_memory_to_tensorboard=True))).log_memory_to_tensorboard is True
    bad = wrap(BridgeStyleLogger(log_memory_to_tensorboard="false"))  # read as truthy, it turned logging on
    with pytest.raises(ValueError, match=r"^logger.log_memory_to_tensorboard must be true or false .*got 'false'"):
        resolve(bad)
    with pytest.raises(ValueError, match="logger.log_memory_to_tensorboard must be true or false"):
        training_log(1, bad)
    with pytest.raises(ValueError, match=r"logger.tensorboard_dir must be a path string or None; got 123 \(int\)"):
        training_log(1, wrap(BridgeStyleLogger(log_memory_to_tensorboard=True, tensorboard_dir=123)))


# The config package: one frozen Settings class, checked once per resolve.


def test_settings_are_frozen():
    import dataclasses

    from nemo_memlog.config import resolve

    settings = resolve(LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.tensorboard_log_interval = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.no_such_attribute = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        del settings.writer_mode
    assert settings.tensorboard_log_interval == 5
    # Equal settings compare and hash alike, whatever they came from.
    again = resolve(LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=5))
    assert again == settings and hash(again) == hash(settings) and len({settings, again}) == 1


def test_one_settings_class_written_in_source():
    import copy
    import dataclasses
    import pickle

    from nemo_memlog.config import Settings, from_plain, resolve
    from nemo_memlog.config.schema import Settings as SchemaSettings

    settings = resolve(LoggerConfig(comet_api_key="TOP-SECRET", mlflow_tags={"team": "llm"}))
    assert type(settings) is Settings is SchemaSettings
    assert Settings.__module__ == "nemo_memlog.config.schema"
    assert [cls.__module__ for cls in Settings.__mro__[:-1]] == ["nemo_memlog.config.schema"] * 2
    assert "TOP-SECRET" not in repr(settings) and repr(settings).startswith("Settings(")
    assert from_plain(settings.to_plain()) == settings
    assert copy.deepcopy(settings) == settings and pickle.loads(pickle.dumps(settings)) == settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.copy(settings).writer_mode = "thread"  # a copy is frozen too


def test_resolve_checks_the_fields_once(monkeypatch):
    from nemo_memlog.config import resolve, schema

    cfg = LoggerConfig(log_memory_to_tensorboard=True)
    real = schema.RULES.check
    calls = []

    def counted(logger):  # the real check, counted
        calls.append(logger)
        return real(logger)

    monkeypatch.setattr(schema.RULES, "check", counted)
    settings = resolve(cfg)
    assert len(calls) == 1
    assert resolve(settings) is settings and len(calls) == 1  # a Settings is taken as it is


def test_the_callbacks_settings_are_checked_once(monkeypatch):
    from nemo_memlog.config import resolve, resolve_fields, schema

    real = schema.RULES.check
    calls = []
    monkeypatch.setattr(schema.RULES, "check", lambda logger: (calls.append(logger), real(logger))[1])
    settings = resolve_fields(log_memory_to_tensorboard=True, memory_reduce_scope="world")
    assert len(calls) == 1
    assert settings == resolve(LoggerConfig(log_memory_to_tensorboard=True, memory_reduce_scope="world"))
    with pytest.raises(TypeError, match=r"no field 'memory_reduce_scop' \(did you mean 'memory_reduce_scope'\?\)"):
        resolve_fields(memory_reduce_scop="world")


def test_an_unknown_keyword_names_the_closest_field_also_for_settings():
    from nemo_memlog.config import Settings

    with pytest.raises(TypeError, match=r"^LoggerConfig has no field 'writer_mod' \(did you mean 'writer_mode'\?\)"):
        LoggerConfig(writer_mod="thread")
    with pytest.raises(TypeError, match=r"no field 'writer_mod' \(did you mean 'writer_mode'\?\)"):
        Settings(writer_mod="thread")


def test_the_reduce_exchange_takes_one_of_two_collectives():
    assert LoggerConfig().memory_reduce_exchange == "all_gather"
    assert LoggerConfig(memory_reduce_exchange="all_to_all").memory_reduce_exchange == "all_to_all"
    with pytest.raises(ValueError) as raised:
        LoggerConfig(memory_reduce_exchange="ring")
    assert str(raised.value) == (
        "logger.memory_reduce_exchange must be one of 'all_gather', 'all_to_all' (the steady-state collective; "
        "set it alike on every rank); got 'ring' (str)"
    )
    with pytest.raises(ValueError, match="memory_reduce_exchange must be one of"):
        from_overrides(["logger.memory_reduce_exchange=all_reduce"])


def test_one_walk_gives_the_recorded_params_and_the_secrets():
    from nemo_memlog.config import recorded

    cfg = LoggerConfig(comet_api_key="TOP-SECRET", mlflow_tags={"auth_token": "TOKEN-2", "team": "llm"})
    params, secrets = recorded(cfg, cfg)
    assert params == flat_params(cfg)
    assert sorted(secrets) == sorted(secrets_of(cfg)) == ["TOKEN-2", "TOP-SECRET"]


@pytest.mark.parametrize("field", ["memory_reduce_timeout_s", "writer_close_timeout_s"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1, 0, 10**400, 1e12])
def test_a_timeout_must_be_finite_and_positive(field, value):
    """memory_reduce_timeout_s=inf passed, then raised OverflowError in training (a wait's timeout)."""
    with pytest.raises(ValueError, match=rf"^logger\.{field} must be a positive number of seconds, finite"):
        LoggerConfig(**{field: value})
    LoggerConfig(**{field: 0.5})


def test_settings_are_hashable_and_read_only_all_the_way_down():
    """hash(resolve(LoggerConfig(memory_keys={...}))) raised TypeError, and settings.memory_keys["x"] = "y"
    changed a frozen Settings."""
    import copy
    import json
    import pickle

    from nemo_memlog.config import from_plain, resolve

    keys = {"allocated_bytes.all.peak": "peak_allocated_bytes"}
    cfg = LoggerConfig(memory_keys=keys, mlflow_tags={"team": "infra"}, comet_tags=["a"])
    settings = resolve(cfg)
    assert hash(settings) == hash(
        resolve(LoggerConfig(memory_keys=dict(keys), mlflow_tags={"team": "infra"}, comet_tags=["a"]))
    )
    for mutate in (
        lambda: settings.memory_keys.__setitem__("x", "y"),
        lambda: settings.memory_keys.update(x="y"),
        lambda: settings.memory_keys.pop("allocated_bytes.all.peak"),
        lambda: settings.memory_keys.clear(),
        lambda: settings.mlflow_tags.setdefault("x", "y"),
        lambda: settings.mlflow_tags.__delitem__("team"),
    ):
        with pytest.raises(TypeError, match="read-only"):
            mutate()
    keys["x"] = "y"  # the config's own mapping: the settings copied it
    assert dict(settings.memory_keys) == {"allocated_bytes.all.peak": "peak_allocated_bytes"}
    assert settings.comet_tags == ("a",)
    # Every reader still reads it: a dict, JSON, pickle (the writer process), copies, the plain form.
    assert (
        isinstance(settings.memory_keys, dict) and json.loads(json.dumps(settings.memory_keys)) == settings.memory_keys
    )
    assert pickle.loads(pickle.dumps(settings)) == settings and copy.deepcopy(settings) == settings
    assert from_plain(settings.to_plain()) == settings and type(settings.to_plain()["memory_keys"]) is dict
    assert {**settings.memory_keys} == dict(settings.memory_keys)


def test_an_override_error_never_shows_a_secret():
    """from_overrides(["logger.comet_api_key=S", "logger.tensorboard_log_interval=abc"]) raised a ValueError
    whose text held S."""
    secret, password = "S3CRET-override-key", "pw-override-9"
    with pytest.raises(ValueError) as caught:
        from_overrides(
            [
                f"logger.comet_api_key={secret}",
                f"logger.mlflow_tracking_uri=http://alice:{password}@host:5000",
                "logger.tensorboard_log_interval=abc",
            ]
        )
    text = str(caught.value)
    assert "tensorboard_log_interval" in text and "abc" in text
    assert secret not in text and password not in text and "http://alice:***@host:5000" in text


def test_a_uri_password_is_recorded_redacted_and_is_a_secret():
    from nemo_memlog.config import resolve

    cfg = LoggerConfig(
        mlflow_experiment="e", mlflow_run_name="r", mlflow_tracking_uri="http://alice:PW-uri-1@host:5000"
    )
    params, secrets = recorded(cfg, cfg)
    assert params["mlflow_tracking_uri"] == "http://alice:***@host:5000" and "PW-uri-1" in secrets
    assert "PW-uri-1" not in repr(resolve(cfg)) and "alice:***@host" in repr(resolve(cfg))


def test_a_probe_of_fit_writes_its_records_where_fit_reads_them(monkeypatch, tmp_path):
    """NEMO_MEMLOG_PROBE_DIR (set by nemo-memlog fit) wins over memory_record_dir, "off" included,
    while memory logging is on; with it off nothing is recorded, as without the variable."""
    from nemo_memlog.config import LoggerConfig, resolve

    monkeypatch.setenv("NEMO_MEMLOG_PROBE_DIR", str(tmp_path / "probe"))
    for chosen in (None, "off", str(tmp_path / "mine")):
        settings = resolve(LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir=chosen))
        assert settings.record_dir == str(tmp_path / "probe")
    assert resolve(LoggerConfig(log_memory_to_tensorboard=False)).record_dir is None
    monkeypatch.delenv("NEMO_MEMLOG_PROBE_DIR")
    assert resolve(LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir="off")).record_dir is None
