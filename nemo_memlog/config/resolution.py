"""A run's settings, read and checked once: ``resolve`` (any config-like input -> one frozen
Settings), its inverse in the writer process (``from_plain``), the integrations' keyword
arguments (``checked_settings``, ``resolve_fields``), and what the writers record of a run's
config (``recorded``: the params and the secrets, from one walk)."""

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from ..redaction import flattened, redact
from .schema import (
    FIELDS,
    RULES,
    FrozenMap,
    LoggerConfig,
    Settings,
    check_logger_fields,
    default_of,
    logger_section,
    setting,
)


def resolve(config: Any) -> Settings:
    """The Settings of ``config``: a LoggerConfig, any object with its field names (Megatron-Bridge's
    LoggerConfig: our defaults for the fields it lacks), a container whose ``.logger`` is one
    (Megatron-Bridge's ConfigContainer), or a Settings (returned as is: it was checked when it
    was resolved). Raises TypeError for anything else and ValueError for a setting that cannot
    work, naming the field and what to change. The fields are checked once, here: building the
    Settings checks nothing again."""
    if isinstance(config, Settings):
        return config
    logger = logger_section(config)
    check_logger_fields(logger)
    return Settings(**{name: _copied(setting(logger, name)) for name in FIELDS})


def resolve_fields(**fields: Any) -> Settings:
    """The Settings of these LoggerConfig fields (the others: their defaults), checked once:
    ``resolve(LoggerConfig(**fields))`` without checking them twice. An unknown name raises
    LoggerConfig's TypeError, a value that cannot work its ValueError."""
    for name in fields:
        if name not in FIELDS:
            raise TypeError(RULES.unknown_field("LoggerConfig", name))
    return resolve(SimpleNamespace(**{name: fields.get(name, default_of(name)) for name in FIELDS}))


def from_plain(fields: dict[str, Any]) -> Settings:
    """The inverse of ``Settings.to_plain()`` (in the writer process): already checked."""
    return Settings(**{name: _copied(fields.get(name, default_of(name))) for name in FIELDS})


def _copied(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "items"):  # read-only and hashable: Settings are frozen all the way down
        return FrozenMap({str(k): _copied(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and not isinstance(value, (bytes, str))):
        return tuple(_copied(v) for v in value)
    return value


def checked_settings(owner: str, settings: dict, valid: Iterable[str], hint: str = "") -> dict:
    """``settings`` (keyword arguments named as LoggerConfig's fields), unchanged, when every
    name is in ``valid`` and LoggerConfig accepts the values. Else ValueError: the unknown
    names with the valid ones listed (and ``hint``), or the bad field and what to change."""
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"{owner}: unknown setting(s) {unknown}; it takes {list(valid)}{hint}")
    LoggerConfig(**settings)
    return settings


def recorded(run_config: Any, logger: Any) -> tuple[dict[str, Any], list[str]]:
    """What the writers record for a run, and the secrets to scrub from what they echo, from one
    walk of ``run_config``: (``flat_params(run_config)`` with the peak window this run uses (``logger``:
    run_config's logger section or its Settings) always present, also when the logger object lacks
    the field (Megatron-Bridge's LoggerConfig: the report command labels the ``peak_*`` values with
    it); ``secrets_of(run_config)``)."""
    copy, secrets = redact(run_config)
    params = flattened(copy)
    # Named where run_config keeps its logger fields: itself (a logger config), else its .logger.
    # ``logger`` may be run_config's Settings rather than the same object.
    name = "memory_peak_window" if hasattr(run_config, "log_memory_to_tensorboard") else "logger.memory_peak_window"
    params[name] = setting(logger, "memory_peak_window")
    return params, secrets
