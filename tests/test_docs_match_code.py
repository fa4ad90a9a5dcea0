"""The docs that describe the code, checked against it: each check reads a block of the docs
between HTML comment markers (`<!-- name:begin -->` ... `<!-- name:end -->`), so a page can say
anything around it, and the block itself cannot drift from the code without failing here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"


def _block(path: Path, name: str) -> str:
    """The text between `<!-- name:begin -->` and `<!-- name:end -->` in `path` (exactly one)."""
    text = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, f"{path.name}: one {begin} ... {end} block"
    return text[text.index(begin) + len(begin):text.index(end)]


def _first_cells(block: str) -> list[str]:
    """The first cell of each table row in `block` whose first cell is `code` (headings skipped)."""
    return [m.group(1) for m in re.finditer(r"^\|\s*`([^`]+)`\s*\|", block, re.M)]


# --- architecture.md: the file table -----------------------------------------------------------

def _modules_on_disk() -> set[str]:
    """Every module of dtorch/ and launcher/, as the file table spells it: a package as its folder
    with a trailing slash (the row stands for its __init__.py), any other module as its path."""
    found = set()
    for top in ("dtorch", "launcher"):
        for path in (ROOT / top).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            found.add(relative.removesuffix("__init__.py") if path.name == "__init__.py" else relative)
    return found


def _file_table() -> list[str]:
    return _first_cells(_block(ARCHITECTURE, "files"))


def test_architecture_file_table_lists_every_module():
    missing = sorted(_modules_on_disk() - set(_file_table()))
    assert not missing, f"docs/architecture.md's file table lacks (one row each, one line on what it is): {missing}"


def test_architecture_file_table_names_only_files_that_exist():
    extra = sorted(set(_file_table()) - _modules_on_disk())
    assert not extra, f"docs/architecture.md's file table names files that do not exist: {extra}"


def test_architecture_file_table_lists_each_module_once():
    rows = _file_table()
    twice = sorted({row for row in rows if rows.count(row) > 1})
    assert not twice, f"docs/architecture.md's file table lists these more than once: {twice}"


def test_architecture_file_table_check_can_fail():
    # the parser sees the rows: a table it read as empty would pass the "names only" check above
    assert len(_file_table()) > 100 and "dtorch/runtime/protocol.py" in _file_table()
    assert "dtorch/runtime/" in _file_table() and "dtorch/" in _file_table()


# --- architecture.md: the layer table -----------------------------------------------------------

def _layer_rows() -> list[tuple[str, tuple[str, ...]]]:
    rows = []
    for line in _block(ARCHITECTURE, "layers").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue
        rows.append((cells[0], tuple(re.findall(r"`([^`]+)`", cells[1]))))
    return rows


def test_architecture_layer_table_is_test_layers():
    """Top to bottom in the docs, lowest first in LAYERS: the same layers, each placing the same
    modules."""
    from test_layers import LAYERS
    documented = _layer_rows()
    expected = [(name, tuple(names)) for name, names in reversed(LAYERS)]
    assert documented == expected, (
        "docs/architecture.md's layer table (top first) differs from tests/test_layers.py's LAYERS "
        f"(lowest first):\n docs: {documented}\n code: {expected}")
