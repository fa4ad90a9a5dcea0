"""The trace file: Chrome's Trace Event Format (JSON), which Perfetto and chrome://tracing load.

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

pid 0 is the controller (this process): one lane (tid) per thread that issued dtorch calls, one
for the controller's loop (flushes), and as many as needed for reads in flight (they overlap, and
events of one lane must nest). pid r + 1 is worker rank r: one lane of commands, each collective
nested inside its command. Every span is a complete event (ph "X", ts and dur in microseconds
since the profile started, on the controller's clock); "M" events name processes and lanes.

Time waiting on a peer is estimated per collective: a member that enters it before the last of
its group waits for that one, so its wait is (the latest start in the group - its own start),
at most its duration. It is as good as the clock alignment (half a ping's round trip: tens of
microseconds on one host).
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple

from ..errors import ProtocolError
from ..runtime.controller import profiling

__all__ = ["Clock", "WorkerRecording", "build_trace", "check_trace", "CONTROLLER_PID", "FORMAT"]

CONTROLLER_PID = 0
FORMAT = "dtorch.profile/1"
LOOP_TID, READS_TID = 100, 200
ROW_FIELDS = 8   # (seq, command, name, detail, start_ns, duration_ns, status, collectives)


class Clock(NamedTuple):
    """A worker's clock against the controller's: offsets (worker - controller) measured at two
    controller times. A drift larger than the measurements' error (half their round trips) is
    followed linearly; a smaller one is noise (one host: one clock), and the offset of the
    better measurement holds throughout, so durations stay exactly as the worker measured them."""
    start_at: float
    start_offset: float
    start_round_trip: int
    end_at: float
    end_offset: float
    end_round_trip: int

    @classmethod
    def between(cls, start: profiling.ClockReading, end: profiling.ClockReading) -> Clock:
        return cls((start.sent + start.received) / 2, start.offset, start.round_trip,
                   (end.sent + end.received) / 2, end.offset, end.round_trip)

    @property
    def drift(self) -> float:
        return self.end_offset - self.start_offset

    def to_controller(self, worker_ns: float) -> float:
        """c = w - offset(c), offset(c) = start_offset + slope * (c - start_at), solved for c."""
        span = self.end_at - self.start_at
        if span <= 0 or abs(self.drift) <= (self.start_round_trip + self.end_round_trip) / 2:
            better = self.start_offset if self.start_round_trip <= self.end_round_trip else self.end_offset
            return worker_ns - better
        slope = self.drift / span
        return (worker_ns - self.start_offset + slope * self.start_at) / (1 + slope)


class WorkerRecording(NamedTuple):
    rank: int
    label: str
    rows: tuple      # runtime/worker/profiling.py: one row per command
    clock: Clock


def build_trace(recorder, start_ns: int, stop_ns: int, workers: dict, site_of: Callable[[int], str | None],
                problem: str | None = None) -> dict:
    """The whole trace: this process's spans, then each rank's commands on the controller's clock."""
    events = _process(CONTROLLER_PID, "controller", 0) + _controller_events(recorder, start_ns)
    for rank in sorted(workers):
        _check_rows(rank, workers[rank].rows)
    waits = _peer_waits(workers)
    for rank in sorted(workers):
        events += _worker_events(workers[rank], start_ns, site_of, waits)
    ends = [e["ts"] + e["dur"] for e in events if e["ph"] == "X"]
    clocks = {str(rank): _clock_report(w.clock) for rank, w in sorted(workers.items())}
    other = {"format": FORMAT, "window_us": [0.0, max([_us(stop_ns - start_ns)] + ends)],
             "ranks": sorted(workers), "clocks": clocks, "workers_missing": problem}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _us(ns: float) -> float:
    return round(ns / 1000, 3)


def _span(name: str, category: str, pid: int, tid: int, start_ns: float, end_ns: float, origin: int,
          args: dict) -> dict:
    """An X event; ts and end are rounded alike, so spans that nest in ns still nest in us."""
    ts, end = _us(start_ns - origin), _us(end_ns - origin)
    return {"name": name, "cat": category, "ph": "X", "ts": ts, "dur": round(max(end - ts, 0.0), 3),
            "pid": pid, "tid": tid, "args": args}


def _meta(kind: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _process(pid: int, name: str, order: int) -> list:
    return [_meta("process_name", pid, 0, {"name": name}), _meta("process_sort_index", pid, 0, {"sort_index": order})]


def _lane(pid: int, tid: int, name: str) -> list:
    return [_meta("thread_name", pid, tid, {"name": name}), _meta("thread_sort_index", pid, tid, {"sort_index": tid})]


# --- the controller ------------------------------------------------------------------------------
def _controller_events(recorder, origin: int) -> list:
    spans = sorted(recorder.events, key=lambda e: (e[3], -e[4]))
    threads = list(dict.fromkeys(e[2] for e in spans if e[2] not in (profiling.LOOP, profiling.READS)))
    tids = {thread: index + 1 for index, thread in enumerate(threads)}
    events = []
    for thread, tid in tids.items():
        events += _lane(CONTROLLER_PID, tid, f"thread {recorder.thread_names.get(thread, thread)}")
    tids[profiling.LOOP] = LOOP_TID
    if any(e[2] == profiling.LOOP for e in spans):
        events += _lane(CONTROLLER_PID, LOOP_TID, "dtorch-controller loop (flushes)")
    read_lanes = _pack([e for e in spans if e[2] == profiling.READS])
    for index in range(max(read_lanes.values(), default=-1) + 1):
        events += _lane(CONTROLLER_PID, READS_TID + index, "reads in flight" + (f" ({index + 1})" if index else ""))
    for span in spans:
        name, category, lane, start, end, args = span
        tid = READS_TID + read_lanes[id(span)] if lane == profiling.READS else tids[lane]
        events.append(_span(name, category, CONTROLLER_PID, tid, start, end, origin, args))
    return events


def _pack(spans: list) -> dict:
    """Overlapping spans (sorted by start) on the fewest lanes: each goes to the first lane free
    at its start. id(span) -> lane index."""
    lane_ends: list = []
    placed = {}
    for span in spans:
        lane = next((i for i, end in enumerate(lane_ends) if end <= span[3]), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(0)
        lane_ends[lane] = span[4]
        placed[id(span)] = lane
    return placed


# --- the workers ---------------------------------------------------------------------------------
def _check_rows(rank: int, rows) -> None:
    """A worker's rows have the shape runtime/worker/profiling.py sends; ProtocolError otherwise."""
    if type(rows) is not tuple or not all(type(r) is tuple and len(r) == ROW_FIELDS for r in rows):
        raise ProtocolError(f"rank {rank} sent profile rows of an unknown shape: {str(rows)[:120]}")


def _peer_waits(workers: dict) -> dict:
    """(rank, row index, collective index) -> ns that rank waited for the last member of the group."""
    members = collections.defaultdict(list)   # (seq, group, k-th use of that group in the command) -> entries
    for rank, worker in workers.items():
        for row_index, row in enumerate(worker.rows):
            seen = collections.Counter()
            for index, (_kind, group, _, start, duration) in enumerate(row[7]):
                key = (row[0], tuple(group), seen[tuple(group)])
                seen[tuple(group)] += 1
                members[key].append((rank, row_index, index, worker.clock.to_controller(start), duration))
    waits = {}
    for entries in members.values():
        last = max(start for *_, start, _ in entries)
        for rank, row_index, index, start, duration in entries:
            waits[(rank, row_index, index)] = min(max(last - start, 0.0), duration)
    return waits


def _worker_events(worker: WorkerRecording, origin: int, site_of, waits: dict) -> list:
    pid = worker.rank + 1
    events = _process(pid, worker.label, pid) + _lane(pid, 1, "commands")
    to_controller = worker.clock.to_controller
    for row_index, (seq, command, name, detail, start, duration, status, collectives) in enumerate(worker.rows):
        comm_events, comm_ns, wait_ns, sent = [], 0, 0.0, 0
        for index, (kind, group, nbytes, c_start, c_duration) in enumerate(collectives):
            wait = waits.get((worker.rank, row_index, index), 0.0)
            comm_ns, wait_ns, sent = comm_ns + c_duration, wait_ns + wait, sent + nbytes
            comm_events.append(_span(kind, "comm", pid, 1, to_controller(c_start), to_controller(c_start + c_duration),
                                     origin, {"group": list(group), "bytes": nbytes, "wait_us": _us(wait)}))
        args = {"seq": seq, "command": command, "status": status}
        site = site_of(seq)   # None: a Free the controller placed itself, or a line no longer kept
        if site is not None:
            args["site"] = site
        if detail:
            args["detail"] = detail
        if collectives:
            args.update(bytes=sent, comm_us=_us(comm_ns), wait_us=_us(wait_ns))
        events.append(_span(name, "command", pid, 1, to_controller(start), to_controller(start + duration), origin,
                            args))
        events += comm_events
    return events


def _clock_report(clock: Clock) -> dict:
    return {"offset_us": _us(clock.start_offset), "drift_us": _us(clock.drift),
            "round_trip_us": [_us(clock.start_round_trip), _us(clock.end_round_trip)]}


# --- structure -----------------------------------------------------------------------------------
EPSILON_US = 0.002   # rounding to ns in us


def check_trace(trace: dict) -> list[str]:
    """What is wrong with a trace's structure (empty: nothing): the fields every event needs,
    X durations, lanes whose events neither nest nor follow each other, unnamed processes or lanes."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        return ["no traceEvents list"]
    problems = [f"event {i} lacks {field}: {str(e)[:100]}" for i, e in enumerate(events)
                for field in ("name", "ph", "ts", "pid", "tid") if field not in e]
    if problems:
        return problems
    spans = [e for e in events if e["ph"] == "X"]
    problems += [f"X event without dur >= 0: {e}" for e in spans if not e.get("dur", -1) >= 0]
    named = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    problems += [f"pid {pid} has no process_name" for pid in sorted({e["pid"] for e in spans} - named)]
    problems += [f"lane {lane} has no thread_name" for lane in sorted({(e["pid"], e["tid"]) for e in spans} - lanes)]
    if CONTROLLER_PID not in named:
        problems.append("no controller process (pid 0)")
    return problems + _nesting_problems(spans)


def _nesting_problems(spans: list) -> list[str]:
    by_lane = collections.defaultdict(list)
    for e in spans:
        by_lane[(e["pid"], e["tid"])].append(e)
    problems = []
    for lane, lane_spans in sorted(by_lane.items()):
        open_ends: list = []
        for e in sorted(lane_spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + EPSILON_US:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            if open_ends and end > open_ends[-1] + EPSILON_US:
                problems.append(f"lane {lane}: {e['name']} at {e['ts']} us overlaps the span it starts in")
            open_ends.append(end)
    return problems
