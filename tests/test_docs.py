"""docs/configuration.md's tables of fields against ``nemo_memlog.config.LoggerConfig``.

The tables under "## Every field" have the columns ``| field | default | meaning |``. A row's
first cell names one field or several (each in backticks, comma-separated; they share the
default). The default cell is a Python literal, optionally in backticks: ``None``, ``False``,
a number, a quoted string (``"run"``), a list written as in Python. It must equal the field's
default (its ``default_factory()`` for a list): numbers by value (``300`` for ``300.0``), bools
and everything else by value and type. Every field of LoggerConfig is in the tables exactly
once, and every name in the tables is a field.
"""

import ast
import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest

from nemo_memlog.config import LoggerConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SECTION = re.compile(r"^## Every field\n(.*?)(?=^## )", re.DOTALL | re.MULTILINE)
HEADER = "| field | default | meaning |"
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def documented_rows() -> list[tuple[list[str], str]]:
    """(the field names of a row, its default cell) for every row of the section's tables."""
    (section,) = SECTION.findall(PAGE.read_text())
    assert section.count(HEADER) == 2, f"expected two '{HEADER}' tables under '## Every field'"
    rows, in_table = [], False
    for line in section.splitlines():
        if line.strip() == HEADER:
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        if not in_table or set(line) <= set("|- "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) >= 3, f"a row without three cells: {line!r}"
        names = [part.strip() for part in cells[0].split(",")]
        assert all(NAME.fullmatch(name) for name in names), f"field cell not `a`, `b`: {cells[0]!r}"
        rows.append(([NAME.fullmatch(name).group(1) for name in names], cells[1]))
    return rows


def parse_default(cell: str):
    text = cell[1:-1] if len(cell) >= 2 and cell[0] == cell[-1] == "`" else cell
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pytest.fail(f'default {cell!r} is not a Python literal (write strings quoted: `"run"`)')


def code_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    assert f.default is not dataclasses.MISSING, f"{f.name} has no default"
    return f.default


def same(documented, actual) -> bool:
    if isinstance(actual, bool) or isinstance(documented, bool):
        return type(documented) is type(actual) and documented == actual
    if isinstance(actual, (int, float)) and isinstance(documented, (int, float)):
        return documented == actual
    return type(documented) is type(actual) and documented == actual


def test_every_field_is_documented_once():
    documented = Counter(name for names, _ in documented_rows() for name in names)
    fields = [f.name for f in dataclasses.fields(LoggerConfig)]
    assert sorted(set(fields) - set(documented)) == [], "fields missing from docs/configuration.md"
    assert sorted(set(documented) - set(fields)) == [], "names in docs/configuration.md that are no field"
    assert {name: n for name, n in documented.items() if n > 1} == {}, "fields documented more than once"


def test_every_documented_default_is_the_codes():
    fields = {f.name: f for f in dataclasses.fields(LoggerConfig)}
    wrong = {}
    for names, cell in documented_rows():
        documented = parse_default(cell)
        for name in names:
            if name in fields and not same(documented, code_default(fields[name])):
                wrong[name] = (cell, code_default(fields[name]))
    assert wrong == {}, "docs/configuration.md's default -> LoggerConfig's"


def test_the_parser_reads_the_pages_rows():
    # Guards the two tests above against passing on nothing: the page's shape as it is.
    rows = documented_rows()
    assert len(rows) >= 15
    assert ["wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity"] in [names for names, _ in rows]
    assert parse_default('`"run"`') == "run" and parse_default("None") is None
    assert same(300, 300.0) and not same(0, False) and not same("1", 1)
