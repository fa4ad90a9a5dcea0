"""`python -m dtorch.profile summarize trace.json`: where the time went, as text.

Three tables: the ops that took the most worker time (summed over ranks), this process's calls
(op issues, reads, flushes, backward, optimizer steps), and per rank the shares of the profile's
window spent computing, in collectives, waiting on a peer inside them (part of the collective
share) and idle (no command running: waiting for the controller's next one).

Every instant counts once. Spans nest: a `dtorch.compile` replay (`RunGraph`) holds its rows as
commands of their own, a command holds its collectives, an op's issue holds the redistribute
dtorch inserted. So a row's time is its self time, the span less the commands nested in it, and
a rank's compute, communication and idle shares add up to 100% of the window, compiled or not.
Nothing here needs more than the standard library (matplotlib is only for `plot`).
"""
from __future__ import annotations

import collections
import json
import os

from .trace import CONTROLLER_PID

__all__ = ["load", "summarize", "self_times"]


def load(path: str | os.PathLike) -> dict:
    with open(path) as file:
        return json.load(file)


def summarize(trace: dict, top: int = 10) -> str:
    """The three tables as text; `top`: rows of the ops and the controller's tables (default 10)."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    window = _window(trace, spans)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    owners = self_times([e for e in spans if e["cat"] in ("command", "comm") or e["pid"] == CONTROLLER_PID])
    commands = [e for e in spans if e["pid"] != CONTROLLER_PID and e["cat"] == "command"]
    lines = [f"dtorch profile: {window / 1000:.3f} ms, {len(names) - 1} rank(s)"]
    missing = trace.get("otherData", {}).get("workers_missing")
    if missing:
        lines.append(f"(part of the trace is missing: {missing})")
    lines += ["", f"Top ops by worker time (all ranks, top {top}):",
              "  self: the command's own time, less the commands nested in it (a compiled replay's rows);",
              "  shares of self time add to 100%; with nested: the whole span"]
    lines += _top_ops(commands, owners, top)
    lines += ["", "Controller (this process):",
              "  ms: whole calls; self ms: less the calls nested in them (an op's inserted redistribute)"]
    lines += _controller(spans, owners, top)
    lines += ["", "Per rank (shares of the window; compute + communication + idle = 100%):"]
    lines += _per_rank(commands, owners, names, window)
    return "\n".join(lines)


class Owned:
    """What nests in one span: the time of its direct children, and its collectives' (comm
    spans whose innermost enclosing command it is)."""
    __slots__ = ("self_us", "comm_us", "wait_us", "sent", "nested")

    def __init__(self, span: dict):
        self.self_us, self.comm_us, self.wait_us, self.sent, self.nested = span["dur"], 0.0, 0.0, 0, False


def self_times(spans: list) -> dict:
    """id(span) -> Owned, lane by lane: each span's time less its direct children's (spans of a
    lane nest or follow each other: check_trace). A collective is charged to the command it
    runs in, not to a replay around that command."""
    by_lane = collections.defaultdict(list)
    for e in spans:
        by_lane[(e["pid"], e["tid"])].append(e)
    owned = {}
    for lane_spans in by_lane.values():
        open_spans: list = []
        for e in sorted(lane_spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"] + _EPSILON_US:
                open_spans.pop()
            owned[id(e)] = Owned(e)
            parent = owned[id(open_spans[-1])] if open_spans else None
            if parent is not None and e["cat"] == "comm":
                parent.comm_us += e["dur"]
                parent.wait_us += e["args"].get("wait_us", 0.0)
                parent.sent += e["args"].get("bytes", 0)
            elif parent is not None:
                parent.self_us -= e["dur"]
                parent.nested = True
            if e["cat"] != "comm":   # collectives nest nothing
                open_spans.append(e)
    for entry in owned.values():
        entry.self_us = max(entry.self_us, 0.0)
    return owned


_EPSILON_US = 0.002   # ts and dur are rounded to ns in us: a child may end a rounding step late


def _window(trace: dict, spans: list) -> float:
    recorded = trace.get("otherData", {}).get("window_us")
    if recorded:
        return max(recorded[1] - recorded[0], 1e-3)
    return max([e["ts"] + e["dur"] for e in spans] + [1e-3])


def _table(header: tuple, rows: list) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return ["  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [header] + rows]


def _top_ops(commands: list, owners: dict, top: int) -> list[str]:
    own, whole, comm = collections.Counter(), collections.Counter(), collections.Counter()
    nested: set = set()
    seqs = collections.defaultdict(set)
    for e in commands:
        entry = owners[id(e)]
        own[e["name"]] += entry.self_us
        whole[e["name"]] += e["dur"]
        comm[e["name"]] += entry.comm_us
        seqs[e["name"]].add(e["args"].get("seq"))
        if entry.nested:
            nested.add(e["name"])
    everything = sum(own.values()) or 1e-9
    rows = [(name, len(seqs[name]), f"{us / 1000:.3f}", f"{100 * us / everything:.1f}%",
             f"{us / max(len(seqs[name]), 1):.1f}", f"{100 * comm[name] / us:.0f}%" if us else "-",
             f"{whole[name] / 1000:.3f}" if name in nested else "-")
            for name, us in own.most_common(top)]
    if not rows:
        return ["  (no worker commands recorded)"]
    return _table(("op", "calls", "self rank-ms", "share", "self us/call", "in collectives", "with nested ms"), rows)


def _controller(spans: list, owners: dict, top: int) -> list[str]:
    mine = [e for e in spans if e["pid"] == CONTROLLER_PID]
    total, own = collections.Counter(), collections.Counter()
    count, longest = collections.Counter(), collections.Counter()
    for e in mine:
        key = (e["cat"], e["name"])
        total[key] += e["dur"]
        own[key] += owners[id(e)].self_us
        count[key] += 1
        longest[key] = max(longest[key], e["dur"])
    rows = [(category, name, count[(category, name)], f"{us / 1000:.3f}", f"{own[(category, name)] / 1000:.3f}",
             f"{us / count[(category, name)]:.1f}", f"{longest[(category, name)]:.1f}")
            for (category, name), us in total.most_common(top)]
    if not rows:
        return ["  (no controller spans recorded)"]
    return _table(("kind", "name", "count", "ms", "self ms", "mean us", "max us"), rows)


def _per_rank(commands: list, owners: dict, names: dict, window: float) -> list[str]:
    rows = []
    for pid in sorted(p for p in names if p != CONTROLLER_PID):
        mine = [owners[id(e)] for e in commands if e["pid"] == pid]
        busy = sum(entry.self_us for entry in mine)          # every instant under one command, once
        comm = sum(entry.comm_us for entry in mine)
        wait = sum(entry.wait_us for entry in mine)
        sent = sum(entry.sent for entry in mine)
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
