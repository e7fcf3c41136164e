"""keys.py, the one table of the report's keys: the README's metric table says what it says, the
report produces its keys in its order, and no module of the package writes a key out again."""

import ast
import re
from pathlib import Path

from nemo_memlog import keys, parts
from nemo_memlog.rank.memory import DEFAULT_MEMORY_KEYS, capacity_report, report_memory

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nemo_memlog"
#: Where a key may still be written out: its definition; parts.py's names of the outside part
#: (tests/test_shape.py reads them from its source); a framework's own names for our keys (the
#: Megatron-LM integration maps its text log's figures); the test helpers' made-up records, which
#: spell keys as a user reads them.
WRITTEN_OUT_ALLOWED = {"keys.py", "parts.py", "integrations/megatron_lm.py"}
WRITTEN_OUT_ALLOWED_UNDER = ("testing/",)
#: A name of another thing that happens to be a key's: advise's JSON gives each change's own headroom.
SAME_NAME_OTHER_THING = {("offline/advise/__init__.py", "headroom_gb")}


def readme_rows() -> list[tuple[list[str], str]]:
    """(names, meaning) of each row of the README's metric table ("What is logged") that names keys
    themselves: the row's first name without its ``memory/`` prefix. A row of a family
    (``memory/phase/<name>/peak_host_rss_gb, peak_allocated_gb``: every name in it is the family's)
    is left out."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## What is logged", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        names_cell, meaning = (cell.strip() for cell in line.strip().strip("|").split(" | ", 1))
        names = re.findall(r"`([^`]+)`", names_cell)
        assert names[0].startswith("memory/"), line
        if flat(names[0].removeprefix("memory/")):
            rows.append(([names[0].removeprefix("memory/"), *names[1:]], meaning))
    assert len(rows) >= 9, "the README's metric table was not found"
    return rows


def flat(name: str) -> bool:
    """A key itself, not a family of them (``peak_stage/<name>``, ``pp_stage_{i}/...``)."""
    return not any(mark in name for mark in "/<{*")


def test_the_readme_states_each_logged_key_as_the_table_does():
    rows = readme_rows()
    row_of = {name: meaning for names, meaning in rows for name in names if flat(name)}
    for key in keys.KEYS:
        if not key.logged:
            assert key.key not in row_of, f"{key.key} is not logged, yet the README's table names it"
            continue
        assert key.key in row_of, f"the README's metric table lacks {key.key} ({key.meaning})"
        assert row_of[key.key] == key.meaning, f"{key.key}: the README says {row_of[key.key]!r}"


def test_every_key_the_readme_names_is_in_a_table_with_its_unit():
    units = {key.key: key.unit for key in keys.KEYS} | {part.key: part.unit for part in parts.PARTS}
    section = (ROOT / "README.md").read_text().split("## What is logged", 1)[1]
    assert "(GB = 1e9 bytes)" in section.split("|", 1)[0]
    for names, meaning in readme_rows():
        whole = [name for name in names if flat(name)]
        unknown = [name for name in whole if name not in units]
        assert not unknown, f"README names {unknown}, which neither keys.py nor parts.py defines"
        for name in whole:
            if name.endswith("_gb"):
                assert units[name] == keys.GB, (name, units[name])
            elif name.endswith("_pct"):
                assert units[name] == keys.PERCENT, (name, units[name])
            elif units[name] == keys.COUNT:  # the README says which are ints
                assert re.search(r"\bints?\b", meaning), (name, meaning)
            else:  # where a figure is: a stage or a rank
                assert units[name] in (keys.STAGE, keys.RANK), (name, units[name])
                assert re.search(r"\bwhere\b|\bstage\b|\brank\b", meaning), (name, meaning)


def test_the_report_produces_the_table_s_keys_in_its_order():
    assert dict(DEFAULT_MEMORY_KEYS) == dict(keys.ALLOCATOR_KEYS)
    assert list(report_memory()) == [key for _, key in keys.ALLOCATOR_KEYS] + [*keys.HOST_KEYS, *keys.DEVICE_KEYS]
    assert list(capacity_report()) == list(keys.CAPACITY_KEYS)
    assert len({key.key for key in keys.KEYS}) == len(keys.KEYS), "a key defined twice"
    assert set(keys.COUNTER_KEYS) == {"alloc_retries", "num_ooms", "allocation_count"}


def test_no_module_writes_a_key_out_again():
    """A string that is exactly a key, outside keys.py (and the places named above), is a second
    definition of it: read it by name from keys.py instead."""
    names = {key.key for key in keys.KEYS}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in WRITTEN_OUT_ALLOWED or relative.startswith(WRITTEN_OUT_ALLOWED_UNDER):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and node.value in names
                and (relative, node.value) not in SAME_NAME_OTHER_THING
            ):
                found.append(f"  nemo_memlog/{relative}:{node.lineno}: {node.value!r}")
    assert not found, "report keys written out (use nemo_memlog.keys):\n" + "\n".join(found)
