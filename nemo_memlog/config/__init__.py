"""nemo_memlog's configuration, one module per job:

- schema.py: ``LoggerConfig`` (Megatron-Bridge's field names and ours), the frozen ``Settings``
  a run reads, and reading a field of any config-like object (``setting``, ``logger_section``);
- validation.py: the type and value rules of the fields, and the one message for a bad value;
- resolution.py: ``resolve`` (any config -> one Settings, checked once) and what the writers
  record of a run's config;
- overrides.py: ``from_overrides``, a LoggerConfig from dotted command-line overrides;
- text.py: settings typed from text (``--set``, ``NEMO_MEMLOG_<FIELD>``) by each field's declared type;
- facts.py: the rules of the run's facts (``training_log(..., facts=...)``), checked once;
- switches.py: the environment's switches (``NEMO_MEMLOG_DISABLED``...), read one way (``switched_off``);
- the secrets in a config (one walk that redacts and collects them, and scrubbing) are
  ../redaction.py's, a leaf the warnings and the writers reach too.

Every name the package, its scripts and tests import from ``nemo_memlog.config`` is here.
"""

from ..redaction import REDACTED, flat_params, redact, redact_uri, scrubbed, secret_name, secrets_of
from .facts import checked_facts
from .overrides import EXPECTED_FORM, from_overrides
from .resolution import checked_settings, from_plain, recorded, resolve, resolve_fields
from .schema import (
    BACKEND_SETTINGS,
    FIELDS,
    FrozenMap,
    LoggerConfig,
    Settings,
    check_logger_fields,
    default_of,
    logger_section,
    memory_record_dir,
    setting,
)
from .switches import switched_off
from .text import TextError, field_from_text, fields_from_text
from .validation import PEAK_WINDOWS, RECORD_OFF, REDUCE_BACKENDS, REDUCE_EXCHANGES, WRITER_MODES, did_you_mean

__all__ = [
    "BACKEND_SETTINGS",
    "EXPECTED_FORM",
    "FIELDS",
    "PEAK_WINDOWS",
    "RECORD_OFF",
    "REDACTED",
    "REDUCE_BACKENDS",
    "REDUCE_EXCHANGES",
    "secret_name",
    "WRITER_MODES",
    "LoggerConfig",
    "FrozenMap",
    "Settings",
    "TextError",
    "check_logger_fields",
    "checked_facts",
    "checked_settings",
    "default_of",
    "field_from_text",
    "fields_from_text",
    "did_you_mean",
    "flat_params",
    "from_overrides",
    "from_plain",
    "logger_section",
    "memory_record_dir",
    "recorded",
    "redact",
    "redact_uri",
    "resolve",
    "resolve_fields",
    "scrubbed",
    "secrets_of",
    "setting",
    "switched_off",
]
