"""Turn result rows into the printed table, a JSON file, a Markdown table and a PNG plot.

Ratios divide each row's median by the median of its reference row from the SAME run: on a
shared machine absolute times drift, ratios much less.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
from dataclasses import asdict
from pathlib import Path

from . import steal
from .per_op_summary import markdown_lines
from .timing import Row, format_seconds, ratio

__all__ = ["ratio", "format_seconds", "format_value", "text_table", "markdown_report", "write_json", "read_json",
           "write_plot", "machine_info", "publish"]

COLUMNS = ("case", "variant", "per", "median", "p90", "vs reference", "note")
DOCS_BEGIN, DOCS_END = "<!-- results:begin -->", "<!-- results:end -->"


def format_value(value: float, unit: str) -> str:
    """Seconds as format_seconds does; any other unit (bytes: "B") as a plain number."""
    if unit == "s" or math.isnan(value):
        return format_seconds(value)
    return f"{value:.4g} {unit}"


def _cells(row: Row, rows: list[Row]) -> list[str]:
    if row.status != "ok":
        return [row.case, row.variant, row.per, "-", "-", row.status, row.note]
    found = ratio(row, rows)
    versus = "reference" if row.reference is None else (
        f"{found:.2f}x {row.reference[1]}" if found is not None else "n/a")
    return [row.case, row.variant, row.per, format_value(row.median, row.unit), format_value(row.p90, row.unit),
            versus, row.note]


def _sections(rows: list[Row], titles: dict[str, str], stolen: dict):
    """(title, its rows' cells) per benchmark that has rows; the title says how much CPU time the
    host stole while it ran (steal.py), where that was measured."""
    for name, title in titles.items():
        section = [row for row in rows if row.benchmark == name]
        if section:
            if name in stolen:
                title += f" ({steal.describe(stolen[name])})"
            yield title, [_cells(row, rows) for row in section]


def text_table(rows: list[Row], titles: dict[str, str], stolen: dict) -> str:
    lines = []
    for title, cells in _sections(rows, titles, stolen):
        widths = [max(len(c[i]) for c in cells + [list(COLUMNS)]) for i in range(len(COLUMNS))]
        lines += ["", title, "  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
    return "\n".join(lines)


def markdown_report(rows: list[Row], titles: dict[str, str], meta: dict) -> str:
    machine = meta["machine"]
    lines = [f"Command: `{meta['command']}` ({meta['suite']} suite, {meta['duration_s']:.0f} s, {meta['date']})",
             "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    lines += markdown_lines(rows)
    for title, cells in _sections(rows, titles, meta.get("steal", {})):
        lines += [f"#### {title}", "", "| " + " | ".join(COLUMNS) + " |",
                  "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in cell) + " |" for cell in cells]
        lines.append("")
    return "\n".join(lines)


def write_json(rows: list[Row], meta: dict, path: Path) -> None:
    records = [dict(asdict(row), median=row.median, p90=row.p90, ratio=ratio(row, rows)) for row in rows]
    path.write_text(json.dumps(dict(meta, rows=records), indent=1, default=_json_safe))


def read_json(path: Path) -> tuple[list[Row], dict]:
    """(rows, meta) as write_json saved them: a run's results, reported again without measuring."""
    saved = json.loads(path.read_text())
    names = set(Row.__dataclass_fields__)
    rows = [Row(**{k: tuple(v) if k == "reference" and v is not None else v for k, v in record.items() if k in names})
            for record in saved.pop("rows")]
    return rows, saved


def _json_safe(value):
    return None if isinstance(value, float) and math.isnan(value) else str(value)


def machine_info() -> dict:
    import torch
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory": _memory(),
            "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory() -> str:
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        return f"{kib / (1 << 20):.0f} GiB"
    except (OSError, ValueError, IndexError):
        return "unknown"


def write_plot(rows: list[Row], titles: dict[str, str], path: Path) -> str | None:
    """Write the PNG, or return why not (matplotlib is an optional `bench` extra)."""
    try:
        from .plot import draw
    except ImportError as error:
        return f"skipped the plot: {error} (pip install 'dtorch[bench]' to get matplotlib)"
    draw(rows, titles, path)
    return None


def publish(markdown: str, plot: Path | None, docs_page: Path) -> None:
    """Replace the results block of docs/design/benchmarks.md and copy the plot beside it."""
    text = docs_page.read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{docs_page} has no {DOCS_BEGIN} ... {DOCS_END} block to replace")
    head, rest = text.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1]
    docs_page.write_text(f"{head}{DOCS_BEGIN}\n{markdown}\n{DOCS_END}{tail}")
    if plot is not None and plot.exists():
        shutil.copyfile(plot, docs_page.with_suffix(".png"))
