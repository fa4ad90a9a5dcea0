"""The docs that describe the code, checked against it: each check reads a block of the docs
between HTML comment markers (`<!-- name:begin -->` ... `<!-- name:end -->`), so a page can say
anything around it, and the block itself cannot drift from the code without failing here.

- docs/design/architecture.md: the file table lists every module of dtorch/ and launcher/, once,
  and nothing else; the layer table is tests/test_layers.py's LAYERS.
- docs/reference/protocol.md: its version and its tables of commands and messages are
  protocol.py's.
- every docs/ path cited in the repository (README, docs, code, tests) exists, and every relative
  link in README.md and docs/ leads to a file and heading that exist.
- docs/guide/ stays under 120 KB."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "design" / "architecture.md"


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
    assert not missing, ("docs/design/architecture.md's file table lacks (one row each, one line on what it is): "
                         f"{missing}")


def test_architecture_file_table_names_only_files_that_exist():
    extra = sorted(set(_file_table()) - _modules_on_disk())
    assert not extra, f"docs/design/architecture.md's file table names files that do not exist: {extra}"


def test_architecture_file_table_lists_each_module_once():
    rows = _file_table()
    twice = sorted({row for row in rows if rows.count(row) > 1})
    assert not twice, f"docs/design/architecture.md's file table lists these more than once: {twice}"


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
        "docs/design/architecture.md's layer table (top first) differs from tests/test_layers.py's LAYERS "
        f"(lowest first):\n docs: {documented}\n code: {expected}")


# --- protocol.md: the version and the record tables ---------------------------------------------

PROTOCOL = DOCS / "reference" / "protocol.md"


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells; `\\|` inside a cell is not a separator."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _rows(block: str) -> list[list[str]]:
    return [cells for cells in map(_cells, block.splitlines())
            if cells and not set(cells[0]) <= set("-: ") and cells[0] not in ("command", "record (`Kind`)")]


def _field_names(cell: str) -> list[str]:
    """The field names a cell lists: "a, b (a note, with commas), c" -> [a, b, c]; "—" or "(none)"
    -> []. Parenthesized notes (nested too) and backticks are dropped."""
    out, depth = [], 0
    for ch in cell.replace("`", ""):
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    names = [part.strip() for part in "".join(out).split(",")]
    return [n for n in names if n not in ("", "—")]


def _protocol():
    from dtorch.runtime import protocol
    return protocol


def test_protocol_doc_version_is_the_code_s():
    title = PROTOCOL.read_text().splitlines()[0]
    found = re.fullmatch(r"# The wire protocol \(version (\d+)\)", title)
    assert found, f"docs/reference/protocol.md's title should say the version: {title!r}"
    assert int(found.group(1)) == _protocol().VERSION, (
        f"docs/reference/protocol.md says version {found.group(1)}; dtorch/runtime/protocol.py's VERSION is "
        f"{_protocol().VERSION}: say what changed in the page and update its title")


def test_protocol_doc_lists_every_command_with_its_fields_and_handler():
    protocol = _protocol()
    rows = _rows(_block(PROTOCOL, "commands"))
    documented = [row[0] for row in rows]
    expected = [command.__name__ for command in protocol.COMMANDS]
    assert documented == expected, (
        "docs/reference/protocol.md's command table (opcode order) differs from protocol.COMMANDS:\n"
        f" missing: {[c for c in expected if c not in documented]}\n"
        f" not in the code: {[c for c in documented if c not in expected]}\n docs: {documented}\n code: {expected}")
    for (name, fields, handler, *_), command in zip(rows, protocol.COMMANDS):
        assert _field_names(fields) == list(command._fields[1:]), (
            f"docs/reference/protocol.md, {name}: fields {_field_names(fields)}, "
            f"protocol.py: {list(command._fields[1:])}")
        assert handler.startswith(f"`{protocol.handler_name(command)}`"), (
            f"docs/reference/protocol.md, {name}: the handler column should start with "
            f"`{protocol.handler_name(command)}`")


def test_protocol_doc_lists_every_message_with_its_kind_and_fields():
    protocol = _protocol()
    rows = _rows(_block(PROTOCOL, "messages"))
    documented = [re.fullmatch(r"`(\w+)` \((\w+)\)", row[0]).groups() for row in rows]
    expected = [(message.__name__, kind.name) for message, kind in protocol.MESSAGES.items()]
    assert documented == expected, ("docs/reference/protocol.md's message table differs from protocol.MESSAGES:\n"
                                    f" {documented}\n {expected}")
    for row, message in zip(rows, protocol.MESSAGES):
        assert _field_names(row[2]) == list(message._fields), (
            f"docs/reference/protocol.md, {message.__name__}: fields {_field_names(row[2])}, "
            f"protocol.py: {list(message._fields)}")


def test_protocol_doc_checks_can_fail():
    assert _field_names("a, b (x, (y, z)), `c` (none)") == ["a", "b", "c"]
    assert _field_names("(none)") == [] and _field_names("— (every rank replies)") == []
    assert len(_rows(_block(PROTOCOL, "commands"))) == len(_protocol().COMMANDS) > 20


# --- links: every docs/ path the repository cites exists ----------------------------------------

# Where a docs/ path may be cited. CHANGELOG.md is history: it names pages where they were.
CITING = ("README.md", "docs", "dtorch", "launcher", "benchmarks", "scripts", "examples", "tests", "pyproject.toml")
DOCS_PATH = re.compile(r"\bdocs/[\w./-]*\w\.(?:md|png)\b")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _citing_files():
    for name in CITING:
        path = ROOT / name
        if path.is_file():
            yield path
        else:
            yield from sorted(p for p in path.rglob("*") if p.suffix in (".md", ".py", ".sh", ".toml")
                              and "__pycache__" not in p.parts)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def test_every_cited_docs_path_exists():
    missing = []
    for path in _citing_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            missing += [f"{path.relative_to(ROOT)}:{number}: {cited}" for cited in DOCS_PATH.findall(line)
                        if not (ROOT / cited).exists()]
    assert not missing, "these docs/ paths do not exist (moved or renamed?):\n" + "\n".join(missing)


def test_every_relative_link_in_the_docs_resolves():
    """Markdown links in README.md and docs/ to files of this repository (and their #anchors, to
    a heading of the page) lead somewhere."""
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for target in MARKDOWN_LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue   # http(s): and mailto: links
                file, _, anchor = target.partition("#")
                resolved = (page.parent / file).resolve() if file else page
                if not resolved.exists():
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such file)")
                elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checks_can_fail():
    gone = "docs/" + "gone.md"   # spelled so that this file cites no missing page itself
    assert DOCS_PATH.findall(f"see docs/guide/models.md, and {gone}.") == ["docs/guide/models.md", gone]
    assert not (ROOT / gone).exists()
    assert _slug("Which calls wait") == "which-calls-wait"
    assert _slug("`dtorch.compile`: one command") == "dtorchcompile-one-command"


# --- the guide stays short ----------------------------------------------------------------------

GUIDE_LIMIT_BYTES = 120 * 1024


def test_the_guide_stays_under_120_kb():
    sizes = {page.name: page.stat().st_size for page in sorted((DOCS / "guide").glob("*.md"))}
    assert {"getting_started.md", "models.md", "training.md", "checkpoints.md", "compile.md", "launching.md",
            "profiling.md", "migrating.md"} <= set(sizes), sorted(sizes)
    total = sum(sizes.values())
    assert total < GUIDE_LIMIT_BYTES, (
        f"docs/guide/ is {total / 1024:.1f} KB, over {GUIDE_LIMIT_BYTES // 1024} KB: move how it works to "
        f"docs/design/ and history to CHANGELOG.md ({sizes})")
