"""The PNG: one panel per benchmark, a bar per row at its median with a whisker to its p90.

Imported only when matplotlib is installed (the `bench` extra); report.py says so otherwise.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on CI machines or over SSH
import matplotlib.pyplot as plt

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from .per_op_summary import per_op_lines
from .timing import Row, format_seconds

__all__ = ["draw"]

REFERENCE_COLOR, DTORCH_COLOR, OTHER_COLOR = "#9e9e9e", "#1f77b4", "#ff7f0e"


def draw(rows: list[Row], titles: dict[str, str], path: Path) -> None:
    panels = [(title, [r for r in rows if r.benchmark == name and r.status == "ok" and r.unit == "s"])
              for name, title in titles.items()]
    panels = [(title, section) for title, section in panels if section]
    summary = per_op_lines(rows)
    heights = ([0.6 + 0.28 * len(summary)] if summary else []) + [0.6 + 0.28 * len(section) for _, section in panels]
    figure, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 0.5),
                                gridspec_kw={"height_ratios": heights}, squeeze=False)
    axes = list(axes[:, 0])
    if summary:
        _summary_panel(axes.pop(0), summary)
    for axis, (title, section) in zip(axes, panels):
        _panel(axis, title, section)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _panel(axis, title: str, section: list[Row]) -> None:
    positions = list(range(len(section)))[::-1]
    medians = [row.median for row in section]
    whiskers = [[0] * len(section), [row.p90 - row.median for row in section]]
    axis.barh(positions, medians, xerr=whiskers, color=[_color(row) for row in section], capsize=2)
    axis.set_yticks(positions, [f"{row.case} | {row.variant}" for row in section], fontsize=7)
    _log_axis(axis, min(medians) / 3, max(row.p90 for row in section) * 3)
    axis.set_xlabel(f"time per {section[0].per} (median, whisker to p90; log scale)", fontsize=7)
    axis.set_title(title, fontsize=9, loc="left")
    axis.tick_params(axis="x", labelsize=7)


def _summary_panel(axis, lines) -> None:
    """Per-op cost over torch eager's, one bar per system; the published figure hatched."""
    positions = list(range(len(lines)))[::-1]
    colors = [DTORCH_COLOR if line.label.startswith("dtorch") else OTHER_COLOR for line in lines]
    bars = axis.barh(positions, [line.ratio for line in lines], color=colors)
    for bar, line in zip(bars, lines):
        if not line.measured:
            bar.set_hatch("//")
            bar.set_facecolor("white")
            bar.set_edgecolor(OTHER_COLOR)
        axis.annotate(f"{line.ratio:.2f}x", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                      xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    axis.axvline(1.0, color=REFERENCE_COLOR, linestyle="--", linewidth=1)
    axis.set_yticks(positions, [line.label for line in lines], fontsize=7)
    axis.set_xscale("log")
    axis.set_xlim(min(line.ratio for line in lines) / 3, max(line.ratio for line in lines) * 4)
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    axis.set_xlabel("per-op time over torch eager's in the same run (log scale; dashed: torch eager; "
                    "hatched: published, not run here)", fontsize=7)
    axis.set_title("Per-op cost against torch eager, (64, 128) elementwise chain", fontsize=9, loc="left")
    axis.tick_params(axis="x", labelsize=7)


def _log_axis(axis, low: float, high: float) -> None:
    # Bars on a log axis start at the left limit, so the limit is set from the data, and the
    # ticks print as "3 us" / "2 ms" rather than powers of ten.
    axis.set_xscale("log")
    axis.set_xlim(low, high)
    axis.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.xaxis.set_minor_formatter(NullFormatter())
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: format_seconds(value)))


def _color(row: Row) -> str:
    if row.variant.startswith("dtorch"):
        return DTORCH_COLOR
    return REFERENCE_COLOR if row.reference is None else OTHER_COLOR
