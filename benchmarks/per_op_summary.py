"""Per-op cost against torch eager, one line per system, all from the same run: the comparison
issue 14 asks the plot to show (dtorch eager and compiled, PyTorch DTensor, Ray and Monarch where
installed), beside DTorch's published figure, which no script here can measure.

Each ratio is the row's own "vs reference" (its median over torch eager's median in the same
benchmark, on the (64, 128) chain of `z * 1.0001 + 1`): benchmarks 1, 6 and 7 each time torch
eager beside their systems. Pure: no matplotlib (plot.py draws it, report.py tabulates it).
"""
from __future__ import annotations

from typing import NamedTuple

from . import dispatch, peers, torch_dtensor
from .timing import Row, ratio

__all__ = ["SummaryLine", "per_op_lines", "markdown_lines", "PUBLISHED_DTORCH"]

CASE = "(64, 128)"
# DTorch's paper: 8.14 us per op for its C++ engine against PyTorch's 5.94 us (issue 14).
PUBLISHED_DTORCH = ("DTorch, C++ engine (published: 8.14 / 5.94 us)", 8.14 / 5.94)
# (label, benchmark, variant): the rows that give one system's per-op cost on the chain.
MEASURED = (
    (f"dtorch eager, {dispatch.WORKERS} workers (issuing thread)", dispatch.NAME, dispatch.DTORCH),
    (f"dtorch.compile replay, {dispatch.WORKERS} workers", dispatch.NAME, dispatch.COMPILED),
    (f"PyTorch DTensor under torchrun, {torch_dtensor.RANKS} ranks", torch_dtensor.NAME, torch_dtensor.DTENSOR),
    (peers.RAY_VARIANTS[0], peers.NAME, peers.RAY_VARIANTS[0]),
    (peers.MONARCH_VARIANTS[0], peers.NAME, peers.MONARCH_VARIANTS[0]),
    (peers.MONARCH_VARIANTS[2], peers.NAME, peers.MONARCH_VARIANTS[2]),
)


class SummaryLine(NamedTuple):
    label: str
    ratio: float      # per-op time over torch eager's
    measured: bool    # False: a published figure, not measured in this run


def per_op_lines(rows: list[Row]) -> list[SummaryLine]:
    """The systems this run measured (rows that failed or are not installed are left out), then
    DTorch's published figure."""
    found = {(row.benchmark, row.variant): row for row in rows if row.case == CASE}
    lines = []
    for label, benchmark, variant in MEASURED:
        row = found.get((benchmark, variant))
        value = ratio(row, rows) if row is not None else None
        if value is not None:
            lines.append(SummaryLine(label, value, True))
    if lines:
        lines.append(SummaryLine(*PUBLISHED_DTORCH, False))
    return lines


def markdown_lines(rows: list[Row]) -> list[str]:
    """A small table for the top of the results block; empty when no system was measured."""
    lines = per_op_lines(rows)
    if not lines:
        return []
    out = [f"#### Per-op cost against torch eager, {CASE} elementwise chain (from benchmarks 1, 6, 7)", "",
           "| system | x torch eager | source |", "|---|---|---|"]
    out += [f"| {line.label} | {line.ratio:.2f}x | {'this run' if line.measured else 'published, not run here'} |"
            for line in lines]
    return out + [""]
