"""The rules a logger config's fields must meet, and the one message for a field that breaks them.

Every field's type rule comes from its annotation on LoggerConfig (one rule per type); some
fields also have a value rule (``VALUE_RULES``) and a text saying what to write (``_TAKES``).
The rules are built from the fields they are given (``FieldRules(dataclasses.fields(LoggerConfig))``,
in schema.py), so this module reads no other part of the config package but the secrets'
names: LoggerConfig, which checks itself when it is built, imports it, not the other way round.
"""

import collections.abc
import dataclasses
import difflib
import math
import os
import typing
from collections.abc import Callable, Iterable
from typing import Any

from ..redaction import secret_name

#: memory_peak_window's values: the peaks of the whole run, or of each logging interval.
PEAK_WINDOWS = ("run", "interval")
WRITER_MODES = ("process", "thread")
#: memory_reduce_backend's values.
REDUCE_BACKENDS = ("auto", "gloo", "group")
#: memory_reduce_exchange's values: the steady-state collective.
REDUCE_EXCHANGES = ("all_gather", "all_to_all")
#: memory_record_dir's value that turns the flight recorder off.
RECORD_OFF = "off"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to a misspelt ``name``, else ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def type_rule(annotation: Any) -> tuple[Callable[[Any], bool], str]:
    """(accepts(value), what to write) for a LoggerConfig field's annotation: bool takes only a
    bool; int an int (not a bool); float an int or float; str a string (``str | None``: also an
    ``os.PathLike``); dict a mapping; list[str] a list or tuple of strings; ``X | None`` also None."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    if optional:
        (annotation,) = [arg for arg in args if arg is not type(None)]
    kind = typing.get_origin(annotation) or annotation
    if kind is bool:
        accepts, text = (lambda v: isinstance(v, bool)), "true or false (a bool: True or False)"
    elif kind is int:
        accepts, text = (lambda v: isinstance(v, int) and not isinstance(v, bool)), "an int"
    elif kind is float:
        accepts, text = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
    elif kind is str and optional:
        accepts, text = (lambda v: isinstance(v, (str, os.PathLike))), "a string"
    elif kind is str:
        accepts, text = (lambda v: isinstance(v, str)), "a string"
    elif kind is dict:
        accepts, text = (lambda v: hasattr(v, "items") and not isinstance(v, str)), "a dict"
    elif kind is list:
        accepts, text = _is_list_of_str, "a list of strings"
    else:
        raise TypeError(f"LoggerConfig: no type rule for {annotation!r}")  # a new field's type: add its rule
    if optional:
        return (lambda v: v is None or accepts(v)), f"{text} or None"
    return accepts, text


def _is_list_of_str(value) -> bool:
    """A list or tuple of strings (or any sequence of them, such as OmegaConf's ListConfig; not a string)."""
    sequence = isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes))
    return sequence and all(isinstance(item, str) for item in value)


#: The longest wait a ``*_s`` setting may ask for: a year. Past about 9.2e9 s Python's own waits
#: (threading, sockets) raise OverflowError; infinity, NaN and negative waits are refused too.
MAX_SECONDS = 365 * 24 * 3600


def _seconds(value, *, zero: bool = False) -> bool:
    """A finite number of seconds, > 0 (``zero``: >= 0), at most MAX_SECONDS."""
    try:
        finite = math.isfinite(value)
    except (OverflowError, TypeError):  # an int too large for a float
        return False
    return finite and (value >= 0 if zero else value > 0) and value <= MAX_SECONDS


#: Fields whose values are further limited (given a value of the right type).
VALUE_RULES: dict[str, Callable[[Any], bool]] = {
    "tensorboard_log_interval": lambda v: v >= 1,
    "writer_buffer_steps": lambda v: v >= 1,
    "memory_reduce_scope": lambda v: v in ("pp", "world"),
    "memory_reduce_backend": lambda v: v in REDUCE_BACKENDS,
    "memory_reduce_exchange": lambda v: v in REDUCE_EXCHANGES,
    "memory_peak_window": lambda v: v in PEAK_WINDOWS,
    "writer_mode": lambda v: v in WRITER_MODES,
    "memory_headroom_warn_fraction": lambda v: 0 <= v < 1,
    "memory_reduce_timeout_s": _seconds,
    "memory_reduce_stall_warn_s": _seconds,
    "writer_close_timeout_s": _seconds,
    "memory_record_dir": lambda v: v is None or bool(os.fspath(v)),
}

_PATH = "a path string or None"
_SECONDS = f"a positive number of seconds, finite and at most {MAX_SECONDS} (a year)"
#: Any other ``*_s`` field (one without a rule of its own): a finite number of seconds, 0 allowed.
_SECONDS_OR_ZERO = f"a finite number of seconds >= 0, at most {MAX_SECONDS} (a year)"
#: What to write, where the field's type alone does not say it.
_TAKES = {
    "tensorboard_log_interval": "an int >= 1 (memory is logged when iteration % interval == 0)",
    "writer_buffer_steps": "an int >= 1",
    "memory_reduce_scope": "'pp' or 'world'",
    "memory_reduce_backend": f"one of {', '.join(map(repr, REDUCE_BACKENDS))} (auto: gloo for the pp scope on "
    f"NCCL jobs; gloo; group: the group's own backend)",
    "memory_reduce_exchange": f"one of {', '.join(map(repr, REDUCE_EXCHANGES))} (the steady-state collective; "
    f"set it alike on every rank)",
    "memory_peak_window": f"one of {', '.join(map(repr, PEAK_WINDOWS))} (peak since the process started, or "
    f"since the previous logging step)",
    "writer_mode": f"one of {', '.join(map(repr, WRITER_MODES))}",
    "memory_headroom_warn_fraction": "a number in [0, 1)",
    "memory_reduce_timeout_s": _SECONDS,
    "memory_reduce_stall_warn_s": _SECONDS,
    "writer_close_timeout_s": _SECONDS,
    "memory_record_dir": f"a folder path, {RECORD_OFF!r} (no recording) or None (beside the run's logs)",
    "memory_keys": "a dict of torch.cuda.memory_stats() names to logged names, or None",
    "memory_per_stage_keys": "a list of name patterns (strings)",
    "tensorboard_dir": _PATH,
    "wandb_save_dir": _PATH,
    "comet_offline_directory": _PATH,
}

_ABSENT = object()


class FieldRules:
    """The rules of a config class's fields (LoggerConfig's): per field, its default and its type
    rule (from its annotation), plus ``VALUE_RULES``. Built once, from ``dataclasses.fields``."""

    def __init__(self, fields: Iterable[dataclasses.Field]):
        self.fields = {f.name: f for f in fields}
        #: Per field: (accepts its type, what to write): one place, one rule per type.
        self.types = {name: type_rule(spec.type) for name, spec in self.fields.items()}
        #: The ``*_s`` number fields without a value rule of their own (their rule: _SECONDS_OR_ZERO).
        self.seconds = [
            name
            for name, (_, text) in self.types.items()
            if name.endswith("_s") and "number" in text and name not in VALUE_RULES
        ]

    def default(self, name: str) -> Any:
        spec = self.fields[name]
        return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default  # type: ignore[misc, operator]

    def read(self, logger: Any, name: str) -> Any:
        """Field ``name`` of any logger config object, with the default when it lacks the field."""
        value = getattr(logger, name, _ABSENT)
        return self.default(name) if value is _ABSENT else value

    def unknown_field(self, owner: str, name: str) -> str:
        """``<owner> has no field 'x' (did you mean 'y'?); fields: ...``."""
        return f"{owner} has no field {name!r}{did_you_mean(name, self.fields)}; fields: {', '.join(self.fields)}"

    def check(self, logger: Any) -> None:
        """Raise ValueError naming the field, what to write and the value given, for a setting that
        cannot work: first each field's type, then its value. Reads only these fields of ``logger``
        (any object with those names: Megatron-Bridge's LoggerConfig has fields of its own, of its
        own types, which are not ours to check)."""
        for name, (accepts, _) in self.types.items():
            value = self.read(logger, name)
            if not accepts(value):
                raise self._refused(name, value)
        for name, valid in VALUE_RULES.items():
            value = self.read(logger, name)
            if not valid(value):
                raise self._refused(name, value)
        for name in self.seconds:  # every other number of seconds: finite, never negative
            value = self.read(logger, name)
            if value is not None and not _seconds(value, zero=True):
                raise self._refused(name, value, _SECONDS_OR_ZERO)
        if self.read(logger, "mlflow_experiment") and not self.read(logger, "mlflow_run_name"):
            raise ValueError("logger.mlflow_experiment is set but logger.mlflow_run_name is not: set both")

    def _refused(self, name: str, value, takes: str = "") -> ValueError:
        """The one message for a setting that cannot work: the field, what to write, and what was
        given (a secret's value is not shown)."""
        takes = takes or _TAKES.get(name) or self.types[name][1]
        kind = type(value).__name__
        shown = repr(value)
        shown = shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown)} characters)"
        given = f"a value of type {kind}" if secret_name(name) else f"{shown} ({kind})"
        return ValueError(f"logger.{name} must be {takes}; got {given}")
