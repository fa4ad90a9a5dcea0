"""`python -m dtorch.profile plot trace.json -o timeline.png`: the trace as a picture, one lane per
controller thread (on top) and one per rank below, for people who would rather look than read.
Perfetto (ui.perfetto.dev) or chrome://tracing show the same file interactively.

matplotlib is the `bench` extra: imported here only, with a clear error when it is missing.
"""
from __future__ import annotations

import os

from ..errors import DTorchError
from .trace import CONTROLLER_PID

__all__ = ["plot"]

COLORS = {"op": "#1f77b4", "command": "#1f77b4", "comm": "#ff7f0e", "read": "#2ca02c", "flush": "#7f7f7f",
          "autograd": "#9467bd", "optimizer": "#8c564b", "redistribute": "#d62728", "call": "#17becf"}
LEGEND = {"op issue / command": "#1f77b4", "collective": "#ff7f0e", "read": "#2ca02c", "flush": "#7f7f7f",
          "backward": "#9467bd", "optimizer step": "#8c564b", "inserted redistribute": "#d62728"}


def plot(trace: dict, out: str | os.PathLike, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise DTorchError("plotting a dtorch trace needs matplotlib: pip install 'dtorch[bench]' (or matplotlib); "
                          "`python -m dtorch.profile summarize` needs nothing more") from None
    matplotlib.use("Agg")   # no display on CI machines or over SSH
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = _lanes(trace)
    figure, axes = plt.subplots(figsize=(14, 0.5 * len(lanes) + 1.5))
    for row, (lane, _label) in enumerate(lanes):
        _draw_lane(axes, -row, [e for e in trace["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == lane])
    axes.set_yticks([-row for row in range(len(lanes))], [label for _, label in lanes], fontsize=8)
    axes.set_xlabel("ms since the profile started (controller clock)")
    axes.set_title(title or "dtorch timeline")
    axes.legend(handles=[Patch(color=c, label=n) for n, c in LEGEND.items()], loc="upper center",
                bbox_to_anchor=(0.5, -0.12), ncol=len(LEGEND), fontsize=8, frameon=False)
    figure.tight_layout()
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


def _draw_lane(axes, y: float, spans: list) -> None:
    """Outermost spans full height, nested ones (collectives, redistributes) as a thinner band."""
    spans = sorted(spans, key=lambda e: (e["ts"], -e["dur"]))
    outer_end = float("-inf")
    for height, keep in ((0.7, True), (0.35, False)):
        chosen, outer_end = [], float("-inf")
        for e in spans:
            is_outer = e["ts"] >= outer_end
            if is_outer:
                outer_end = e["ts"] + e["dur"]
            if is_outer == keep:
                chosen.append(e)
        if chosen:
            axes.broken_barh([(e["ts"] / 1000, max(e["dur"] / 1000, 1e-4)) for e in chosen], (y - height / 2, height),
                             facecolors=[COLORS.get(e["cat"], "#bcbd22") for e in chosen], linewidth=0)
