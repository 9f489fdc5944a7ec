"""docs/design.md describes the package as it is: one row per file of the tree, and every ``[Note: ...]`` defined
in the code is listed there, cited from a call site, and every citation names a note that exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zero_buffers"
DESIGN = ROOT / "docs" / "design.md"
NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def _table(heading: str) -> list[str]:
    """First cells (backticks stripped) of the Markdown table whose header row starts with ``| heading |``."""
    lines = DESIGN.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {heading} |"))
    cells = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells.append(line.split("|")[1].strip())
    return cells


def _package_files() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed")}


def test_the_design_file_table_has_one_row_per_file_of_the_package():
    rows = [c.strip("`") for c in _table("file")]
    assert len(rows) == len(set(rows)), sorted({r for r in rows if rows.count(r) > 1})
    files = _package_files()
    assert not files - set(rows), f"files with no row in docs/design.md: {sorted(files - set(rows))}"
    assert not set(rows) - files, f"rows in docs/design.md for files that do not exist: {sorted(set(rows) - files)}"


def _notes() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(note -> the file defining it, note -> the places citing it). A definition is a line holding only the note
    (``[Note: x]`` or ``# [Note: x]``); every other mention is a citation."""
    defined: dict[str, str] = {}
    cited: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(PACKAGE).as_posix()}:{n}"
            bare = line.strip().removeprefix("#").strip()
            for name in NOTE.findall(line):
                if bare == f"[Note: {name}]":
                    assert name not in defined, f"[Note: {name}] defined twice: {defined[name]} and {where}"
                    defined[name] = where
                else:
                    cited.setdefault(name, []).append(where)
    return defined, cited


def test_every_note_is_defined_once_cited_from_the_code_and_listed_in_the_design_notes_table():
    defined, cited = _notes()
    assert defined, "no [Note: ...] found: the pattern no longer matches the code"
    assert not set(cited) - set(defined), f"cited notes that are defined nowhere: {sorted(set(cited) - set(defined))}"
    uncited = sorted(n for n in defined if not cited.get(n))
    assert not uncited, f"notes no call site cites: {uncited}"
    listed = {NOTE.fullmatch(c).group(1) for c in _table("note") if NOTE.fullmatch(c)}
    assert listed == set(defined), (f"docs/design.md's notes table lists {sorted(listed - set(defined))} that the code "
                                    f"does not define and misses {sorted(set(defined) - listed)}")
