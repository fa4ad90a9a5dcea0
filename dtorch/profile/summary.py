"""`python -m dtorch.profile summarize trace.json`: where the time went, as text.

Three tables: the ops that took the most worker time (summed over ranks), this process's calls
(op issues, reads, flushes, backward, optimizer steps), and per rank the shares of the profile's
window spent computing, in collectives, waiting on a peer inside them (part of the collective
share) and idle (no command running: waiting for the controller's next one).
"""
from __future__ import annotations

import collections
import json
import os

from .trace import CONTROLLER_PID

__all__ = ["load", "summarize"]


def load(path: str | os.PathLike) -> dict:
    with open(path) as file:
        return json.load(file)


def summarize(trace: dict, top: int = 10) -> str:
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    window = _window(trace, spans)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    commands = [e for e in spans if e["pid"] != CONTROLLER_PID and e["cat"] == "command"]
    lines = [f"dtorch profile: {window / 1000:.3f} ms, {len(names) - 1} rank(s)"]
    missing = trace.get("otherData", {}).get("workers_missing")
    if missing:
        lines.append(f"(part of the trace is missing: {missing})")
    lines += ["", f"Top ops by worker time (all ranks, top {top}):"] + _top_ops(commands, top)
    lines += ["", "Controller (this process):"] + _controller(spans, top)
    lines += ["", "Per rank (shares of the window):"] + _per_rank(commands, names, window)
    return "\n".join(lines)


def _window(trace: dict, spans: list) -> float:
    recorded = trace.get("otherData", {}).get("window_us")
    if recorded:
        return max(recorded[1] - recorded[0], 1e-3)
    return max([e["ts"] + e["dur"] for e in spans] + [1e-3])


def _table(header: tuple, rows: list) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return ["  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [header] + rows]


def _top_ops(commands: list, top: int) -> list[str]:
    total = collections.Counter()
    comm = collections.Counter()
    seqs = collections.defaultdict(set)
    for e in commands:
        total[e["name"]] += e["dur"]
        comm[e["name"]] += e["args"].get("comm_us", 0.0)
        seqs[e["name"]].add(e["args"].get("seq"))
    everything = sum(total.values()) or 1e-9
    rows = [(name, len(seqs[name]), f"{us / 1000:.3f}", f"{100 * us / everything:.1f}%",
             f"{us / max(len(seqs[name]), 1):.1f}", f"{100 * comm[name] / us:.0f}%" if us else "-")
            for name, us in total.most_common(top)]
    if not rows:
        return ["  (no worker commands recorded)"]
    return _table(("op", "calls", "rank-ms", "share", "us/call", "in collectives"), rows)


def _controller(spans: list, top: int) -> list[str]:
    mine = [e for e in spans if e["pid"] == CONTROLLER_PID]
    total, count, longest = collections.Counter(), collections.Counter(), collections.Counter()
    for e in mine:
        key = (e["cat"], e["name"])
        total[key] += e["dur"]
        count[key] += 1
        longest[key] = max(longest[key], e["dur"])
    rows = [(category, name, count[(category, name)], f"{us / 1000:.3f}", f"{us / count[(category, name)]:.1f}",
             f"{longest[(category, name)]:.1f}") for (category, name), us in total.most_common(top)]
    if not rows:
        return ["  (no controller spans recorded)"]
    return _table(("kind", "name", "count", "ms", "mean us", "max us"), rows)


def _per_rank(commands: list, names: dict, window: float) -> list[str]:
    rows = []
    for pid in sorted(p for p in names if p != CONTROLLER_PID):
        mine = [e for e in commands if e["pid"] == pid]
        busy = sum(e["dur"] for e in mine)
        comm = sum(e["args"].get("comm_us", 0.0) for e in mine)
        wait = sum(e["args"].get("wait_us", 0.0) for e in mine)
        sent = sum(e["args"].get("bytes", 0) for e in mine)
        rows.append((names[pid].split(" (")[0], len(mine), _share(busy - comm, window), _share(comm, window),
                     _share(wait, window), _share(max(window - busy, 0.0), window), _bytes(sent)))
    if not rows:
        return ["  (no ranks recorded)"]
    return _table(("rank", "commands", "compute", "communication", "of which waiting", "idle", "sent"), rows)


def _share(us: float, window: float) -> str:
    return f"{100 * us / window:.1f}%"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"
