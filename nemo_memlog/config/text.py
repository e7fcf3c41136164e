"""Settings typed from text (``nemo-memlog run --set key=value``, ``NEMO_MEMLOG_<FIELD>=value``), by
each field's declared type on LoggerConfig, never by a guess at what the text looks like: a path is a
string (``memory_record_dir=2024`` is the folder ``2024``), an int field takes only an int.

Per type: bool ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``); int a whole
number; float a finite number; str the text as it is; dict a JSON object of strings; list a JSON array
of strings, or comma-separated items. A field that may be None takes an empty text as None (its
default). The whole is then checked as LoggerConfig checks itself (values, the fields together).
"""

import json
import math
import typing
from collections.abc import Mapping
from typing import Any

from .resolution import resolve_fields
from .schema import FIELDS

#: The words a bool field takes, and what each means.
BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
#: A dict or list field's JSON text longer than this is refused (no setting needs it; the parse stays cheap).
MAX_JSON_CHARS = 65536


class TextError(ValueError):
    """A setting's text that cannot be used: the message names the field and what to write; ``field``
    is its name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def field_from_text(name: str, text: str) -> Any:
    """The value of LoggerConfig field ``name`` written as ``text``, typed by the field's annotation.
    Raises TextError naming the field and what to write (a secret-named field's text is not shown);
    never RecursionError, OverflowError or anything else."""
    annotation = FIELDS[name].type
    args = typing.get_args(annotation)
    optional = type(None) in args
    if optional:
        (annotation,) = [arg for arg in args if arg is not type(None)]
    if optional and text == "":
        return None
    kind = typing.get_origin(annotation) or annotation
    try:
        return _PARSERS[kind](text)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise _refused(name, text, optional) from None


def _bool(text: str) -> bool:
    word = text.strip().lower()
    return BOOL_WORDS[word] if word in BOOL_WORDS else _fail()


def _int(text: str) -> int:
    return int(text.strip(), 10)


def _float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _fail()


def _dict(text: str) -> dict[str, str]:
    value = _json(text)
    ok = isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    return value if ok else _fail()


def _list(text: str) -> list[str]:
    if not text.lstrip().startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]
    value = _json(text)
    return value if isinstance(value, list) and all(isinstance(item, str) for item in value) else _fail()


def _json(text: str) -> Any:
    if len(text) > MAX_JSON_CHARS:
        _fail()
    return json.loads(text)  # a 100,000-deep nesting raises RecursionError, caught by the caller


def _fail() -> typing.NoReturn:
    raise ValueError("not of the field's type")


_PARSERS: dict[Any, Any] = {bool: _bool, int: _int, float: _float, str: str, dict: _dict, list: _list}
_FORMS = {
    bool: "true or false",
    int: "a whole number",
    float: "a finite number",
    str: "a string",
    dict: 'a JSON object of strings, e.g. {"allocated_bytes.all.current": "current_allocated_gb"}',
    list: 'a JSON array of strings, e.g. ["peak_*"], or comma-separated items',
}


def _refused(name: str, text: str, optional: bool) -> TextError:
    annotation = FIELDS[name].type
    kind = [arg for arg in typing.get_args(annotation) if arg is not type(None)] or [annotation]
    form = _FORMS[typing.get_origin(kind[0]) or kind[0]] + (" (empty: None)" if optional else "")
    return TextError(f"logger.{name} must be {form}; got {_shown(name, text)}", name)


def _shown(name: str, text: str) -> str:
    """``text`` as a message may show it: bounded; a secret-named field's not at all."""
    from ..redaction import secret_name

    if secret_name(name):
        return f"a text of {len(text)} characters"
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"


def fields_from_text(texts: Mapping[str, str]) -> dict[str, Any]:
    """``{field: value}`` from ``{field: text}``, each typed by its field's declared type, then checked
    together as LoggerConfig checks itself (each value's rule, the fields that go together). Raises
    TextError for a text not of its type, or (``logger.<field> must be ...``) for a value
    that cannot work, both naming the field (``field``); KeyError for a name that is no field (the
    caller names it first)."""
    values = {name: field_from_text(name, text) for name, text in texts.items()}
    try:
        resolve_fields(**values)
    except ValueError as error:
        field = next((name for name in values if f"logger.{name} " in str(error)), None)
        raise TextError(str(error), field) from None
    return values


__all__ = ["BOOL_WORDS", "TextError", "field_from_text", "fields_from_text"]
