"""`python -m dtorch.profile plot trace.json -o timeline.png`: the trace as a picture, one lane per
controller thread (on top) and one per rank below, for people who would rather look than read.
Perfetto (ui.perfetto.dev) or chrome://tracing show the same file interactively.

`drawing(trace)` decides everything drawn (bars, their colours, the labels), with no matplotlib;
`plot` only renders it. On a worker's lane a command is coloured by its phase (PHASES), an op's
name is written on its bar where it fits, and above the lane each stretch is named after the
phase that took most of it.
Spans nested in others (a compiled replay's rows, a command's collectives) are thinner bands.

matplotlib is the `bench` extra: imported by `plot` only, with a clear error when it is missing.
"""
from __future__ import annotations

import collections
import math
import os
from typing import NamedTuple

from ..errors import DTorchError
from .trace import CONTROLLER_PID

__all__ = ["plot", "drawing", "phase_of", "PHASES"]

# A worker command's phase, by its command type; a collective is "communication" wherever it runs.
# Every op is "forward": the workers cannot tell a loss or a clipping op from a layer's.
PHASE_OF_COMMAND = {"RunOp": "forward", "Factory": "forward", "Backward": "backward",
                    "OptimizerStep": "optimizer", "UpdateGrads": "optimizer", "SetGrads": "optimizer",
                    "GradNorm": "optimizer", "Redistribute": "communication", "Transfer": "communication"}
PHASES = {"forward": "#1f77b4", "backward": "#9467bd", "optimizer": "#8c564b", "communication": "#ff7f0e",
          "compiled replay": "#d9d9d9", "other": "#7f7f7f"}
CONTROLLER_COLORS = {"op": "#aec7e8", "read": "#2ca02c", "flush": "#c7c7c7", "autograd": "#c5b0d5",
                     "optimizer": "#c49c94", "redistribute": "#d62728", "call": "#17becf"}
LEGEND = {**{name: color for name, color in PHASES.items() if name != "other"},
          "controller: op issue": CONTROLLER_COLORS["op"], "read": CONTROLLER_COLORS["read"],
          "inserted redistribute": CONTROLLER_COLORS["redistribute"]}
HEIGHTS = (0.7, 0.45, 0.25)   # a span's bar by how deeply it nests
LANE_PIXELS, CHAR_PIXELS = 1350, 8.0   # the lanes' width in the PNG, one label character's (fontsize 7, generous)


class Bar(NamedTuple):
    row: int
    start_ms: float
    width_ms: float
    depth: int
    color: str


class Label(NamedTuple):
    row: int
    x_ms: float      # the label's centre
    text: str
    kind: str        # "op" (a worker's command) and "call" (this process's): on its bar; "phase": above the lane


class Drawing(NamedTuple):
    lanes: list      # the label of each row, top to bottom
    bars: list
    labels: list
    window_ms: float


def phase_of(span: dict) -> str:
    if span["cat"] == "comm":
        return "communication"
    return PHASE_OF_COMMAND.get(span["args"].get("command", ""), "other")


def drawing(trace: dict) -> Drawing:
    """What `plot` draws: lanes, bars and labels, with nothing of matplotlib (tests read it)."""
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    window = max([e["ts"] + e["dur"] for e in spans] + [trace.get("otherData", {}).get("window_us", [0, 1e-3])[1]])
    lanes = _lanes(trace)
    bars, labels = [], []
    for row, (lane, _label) in enumerate(lanes):
        on_lane = sorted((e for e in spans if (e["pid"], e["tid"]) == lane), key=lambda e: (e["ts"], -e["dur"]))
        depths, containers = _depths(on_lane)
        worker = lane[0] != CONTROLLER_PID
        for e in on_lane:
            color = _color(e, worker, id(e) in containers)
            bars.append(Bar(row, e["ts"] / 1000, e["dur"] / 1000, depths[id(e)], color))
            text = _fitting(e["name"], e["dur"], window)
            if text and e["cat"] != "comm" and id(e) not in containers:   # a replay: its colour and its rows
                labels.append(Label(row, (e["ts"] + e["dur"] / 2) / 1000, text, "op" if worker else "call"))
        if worker:
            labels += _phase_labels(row, on_lane, containers, window)
    return Drawing([label for _, label in lanes], bars, labels, window / 1000)


def plot(trace: dict, out: str | os.PathLike, title: str | None = None) -> None:
    """Write the picture of `trace` to `out` (a PNG); `title` defaults to "dtorch timeline".
    DTorchError saying how to install matplotlib when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise DTorchError("plotting a dtorch trace needs matplotlib, which is not installed: "
                          "pip install matplotlib (or pip install 'dtorch[bench]'). "
                          "`python -m dtorch.profile summarize` needs nothing more") from None
    matplotlib.use("Agg")   # no display on CI machines or over SSH
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    picture = drawing(trace)
    figure, axes = plt.subplots(figsize=(14, 0.7 * len(picture.lanes) + 2))
    for bar in picture.bars:
        height = HEIGHTS[min(bar.depth, len(HEIGHTS) - 1)]
        axes.broken_barh([(bar.start_ms, max(bar.width_ms, 1e-4))], (-bar.row - height / 2, height),
                         facecolors=bar.color, linewidth=0)
    offsets = {"op": (0.0, "center", "white"), "call": (0.0, "center", "black"), "phase": (0.37, "bottom", "black")}
    for label in picture.labels:
        dy, align, color = offsets[label.kind]
        axes.text(label.x_ms, -label.row + dy, label.text, ha="center", va=align, fontsize=7, color=color,
                  clip_on=True, style="italic" if label.kind == "phase" else "normal")
    axes.set_yticks([-row for row in range(len(picture.lanes))], picture.lanes, fontsize=8)
    axes.set_ylim(-len(picture.lanes) + 0.4, 0.65)
    axes.set_xlim(0, picture.window_ms)
    axes.set_xlabel("ms since the profile started (controller clock)")
    axes.set_title(title or "dtorch timeline")
    figure.legend(handles=[Patch(color=c, label=n) for n, c in LEGEND.items()], loc="lower center",
                  ncol=len(LEGEND), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(out, dpi=120)
    plt.close(figure)


def _lanes(trace: dict) -> list:
    """((pid, tid), label) of every lane with spans: the controller's first, then rank by rank."""
    names = {(e["pid"], e["tid"]) if e["name"] == "thread_name" else e["pid"]: e["args"]["name"]
             for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] in ("thread_name", "process_name")}
    used = sorted({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"})

    def label(lane):
        pid, tid = lane
        if pid == CONTROLLER_PID:
            return "controller: " + names.get(lane, str(tid))
        return names.get(pid, f"pid {pid}").split(" (")[0]
    return [(lane, label(lane)) for lane in used]


def _depths(spans: list) -> tuple[dict, set]:
    """id(span) -> how many spans it nests in; and the ids of commands holding other commands
    (a compiled replay's RunGraph). `spans` sorted by (start, -duration)."""
    depths, containers, open_spans = {}, set(), []
    for e in spans:
        while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"] + 0.002:
            open_spans.pop()
        depths[id(e)] = len(open_spans)
        if open_spans and e["cat"] == "command" and open_spans[-1]["cat"] == "command":
            containers.add(id(open_spans[-1]))
        open_spans.append(e)
    return depths, containers


def _color(span: dict, worker: bool, container: bool) -> str:
    if not worker:
        return CONTROLLER_COLORS.get(span["cat"], "#bcbd22")
    return PHASES["compiled replay" if container else phase_of(span)]


def _fitting(text: str, duration_us: float, window_us: float) -> str:
    """`text` as much of it as fits on a bar this long ("" when under three characters would)."""
    room = int(duration_us / window_us * LANE_PIXELS / CHAR_PIXELS) - 1
    if room >= len(text):
        return text
    return text[:room - 1] + "…" if room >= 4 else ""


PHASE_BIN_CHARS = 6   # a phase label names the phase that took most of each stretch this wide


def _phase_labels(row: int, spans: list, containers: set, window: float) -> list:
    """Labels above the lane: the lane is cut into stretches about PHASE_BIN_CHARS characters
    wide, each given the phase that took most of its time (a collective's time is
    communication, not its command's phase); neighbours of one phase make a run, named where
    the name fits and overlaps no wider run's ("other" and idle stretches stay unnamed)."""
    width = window * PHASE_BIN_CHARS * CHAR_PIXELS / LANE_PIXELS
    count = int(window / width) + 1
    bins = [collections.Counter() for _ in range(count)]
    covered = [[math.inf, -math.inf] for _ in range(count)]   # the busy part of each stretch
    for start, end, phase, weight in _phase_time(spans, containers):
        for index in range(int(start / width), min(int(end / width), count - 1) + 1):
            low, high = max(start, index * width), min(end, (index + 1) * width)
            if high > low:
                bins[index][phase] += weight * (high - low)
                covered[index] = [min(covered[index][0], low), max(covered[index][1], high)]
    runs: list = []   # [phase, start, end]
    for index, taken in enumerate(bins):
        phase = max(taken, key=taken.__getitem__) if taken and max(taken.values()) > 0 else None
        if runs and runs[-1][0] == phase:
            runs[-1][2] = covered[index][1]
        else:
            runs.append([phase, *covered[index]])
    labels, placed = [], []   # widest runs first; a label that would overlap one placed is left out
    for phase, start, end in sorted((run for run in runs if run[0] not in (None, "other")),
                                    key=lambda run: run[1] - run[2]):
        text = _fitting(phase, end - start, window)
        half = (len(text) + 1) * CHAR_PIXELS / LANE_PIXELS * window / 2
        centre = (start + end) / 2
        if not text or any(abs(centre - c) < half + h for c, h in placed):
            continue
        placed.append((centre, half))
        labels.append(Label(row, centre / 1000, text, "phase"))
    return sorted(labels, key=lambda label: label.x_ms)


def _phase_time(spans: list, containers: set):
    """(start, end, phase, +1 or -1) of a lane's time: each command outside a replay's own span,
    each collective as communication, taken back from the command it runs in."""
    open_commands: list = []
    for e in spans:   # sorted by (start, -duration)
        while open_commands and open_commands[-1]["ts"] + open_commands[-1]["dur"] <= e["ts"] + 0.002:
            open_commands.pop()
        end = e["ts"] + e["dur"]
        if e["cat"] == "comm":
            yield e["ts"], end, "communication", 1
            parent = open_commands[-1] if open_commands else None
            if parent is not None and id(parent) not in containers:
                yield e["ts"], end, phase_of(parent), -1
        elif e["cat"] == "command":
            open_commands.append(e)
            if id(e) not in containers:
                yield e["ts"], end, phase_of(e), 1
