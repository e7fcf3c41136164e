"""``from_overrides``: a LoggerConfig from dotted overrides, as recipes take them on the command
line (read with OmegaConf, imported only when called)."""

from ..redaction import REDACTED, redact_uri, scrubbed, secret_name, uri_credentials
from .schema import FIELDS, LoggerConfig
from .validation import did_you_mean

EXPECTED_FORM = "expected logger.key=value, e.g. logger.log_memory_to_tensorboard=true"


def from_overrides(overrides: list[str], base: LoggerConfig | None = None) -> LoggerConfig:
    """Build a LoggerConfig from dotted overrides, as recipes take them on the command line.

    Needs omegaconf (``pip install 'nemo_memlog[config]'``).

    Args:
        overrides: ``["logger.log_memory_to_tensorboard=true", "logger.tensorboard_log_interval=10"]``.
            The ``logger.`` prefix is optional; overrides for other sections (``train.iters=5``)
            are ignored. Pass only overrides, not a script's own arguments.
        base: the LoggerConfig the overrides apply to (default: ``LoggerConfig()``).

    Returns:
        A new LoggerConfig, checked.

    Raises:
        ValueError: an item that is no override (a flag, a path), showing the expected form;
            an unknown logger field, naming the closest one; a value of the wrong type or one
            that cannot work, naming the field (a secret's value is not shown).
        ImportError: omegaconf is not installed.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ours = []
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key or key.startswith("-"):
            raise ValueError(
                f"from_overrides: {item!r} is not an override: {EXPECTED_FORM} "
                f"(pass only the overrides, not the script's own arguments)"
            )
        if key.startswith("logger."):
            key = key.removeprefix("logger.")
        elif "." in key:
            continue  # another section's override
        name = key.split(".", 1)[0]
        if name not in FIELDS:
            raise ValueError(
                f"from_overrides: {item!r}: LoggerConfig has no field {name!r}"
                f"{did_you_mean(name, FIELDS)}; {EXPECTED_FORM}.\nKnown logger fields: {', '.join(FIELDS)}"
            )
        ours.append(item.removeprefix("logger."))
    schema = OmegaConf.structured(base or LoggerConfig())
    try:
        merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(ours))
        return OmegaConf.to_object(merged)  # type: ignore[return-value]  # a LoggerConfig: the schema's class
    except OmegaConfBaseException as error:
        known = ", ".join(FIELDS)
        secrets = _secrets(overrides)  # no message carries a secret's value
        shown = [_shown(item) for item in overrides]
        raise ValueError(
            scrubbed(f"bad logger override in {shown!r}: {error.msg}\nKnown logger fields: {known}", secrets)
        ) from None


def _secrets(overrides: list[str]) -> list[str]:
    """The secret values among ``overrides``: a secret-named key's value, a URI's credentials."""
    found = []
    for item in overrides:
        key, _, value = item.partition("=")
        found += [value] if secret_name(key) and value else uri_credentials(value)
    return found


def _shown(item: str) -> str:
    """``item`` as an error message may show it: a secret-named key's value, a URI's password hidden."""
    key, _, value = item.partition("=")
    return f"{key}={REDACTED}" if secret_name(key) and value else f"{key}={redact_uri(value)}"
