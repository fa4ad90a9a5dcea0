"""A worker's side of dtorch.profile: while profiling is on, every command's span on this
worker's clock, and inside it every collective with its group, the bytes this rank sent and its
time. Kept in memory; sent once, when profiling stops, as msgpack rows (never pickle).

Off costs one attribute check per command (Worker.run_command): nothing here runs, and the
worker's communicators are its own, unwrapped. On, the communicators are wrapped by
RecordingComm, so every collective is seen wherever it is issued (redistribute steps, peer
kernels, moves between meshes, backward's duals, agreements on failures) without any of those
knowing about profiling.

A row, as sent:
    (seq, command, name, detail, start_ns, duration_ns, status, collectives)
    command: the command type (RunOp); name: what the user called (add), or the command type;
    detail: the kernel when it differs, the redistribute steps, the factory kind, ...;
    status: "ok", "failed" (this command raised) or "poisoned" (an input had failed);
    collectives: ((kind, group ranks, bytes sent, start_ns, duration_ns), ...)
"""
from __future__ import annotations

import time

from ...spec.placements import format_placements
from ...spec.redistribute import format_steps
from .. import protocol as wire
from .comms import Comms

__all__ = ["CommandRecorder", "RecordingComm", "clock_frame", "sent_bytes"]

_now = time.perf_counter_ns   # CLOCK_MONOTONIC on Linux: one clock for every process of a host


def clock_frame(rows: list | None = None) -> bytes:
    """A reply to Profile: this worker's clock now, then the recorded rows when profiling stops."""
    return wire.pack([_now()] if rows is None else [_now(), rows])


class CommandRecorder:
    """The commands this worker ran since profiling turned on, with their collectives. It takes
    the worker's Comms (comms.py), whose communicators it wraps until `finish`, and the table of
    failed tensor ids (shards.LocalShards.poisoned), which says each command's status."""

    def __init__(self, comms: Comms, poisoned: dict):
        self.comms, self.poisoned = comms, poisoned
        self.rows: list = []          # (command, start_ns, end_ns, collectives, status)
        self.collectives: list = []   # the running command's: filled in by RecordingComm
        self.unwrapped = (comms.comm, comms.host_comm)
        comm = RecordingComm(comms.comm, self)
        comms.comm = comm
        comms.host_comm = comm if comms.host_comm is self.unwrapped[0] else RecordingComm(comms.host_comm, self)

    def record(self, command, execute) -> None:
        """Run the command through `execute` (Worker._execute, which never raises) and keep its span.
        A command may run others inside it (a RunGraph its rows): each keeps its own collectives,
        and the outer one's list is current again once a nested one ends."""
        outer, self.collectives = self.collectives, []
        collectives = self.collectives
        start = _now()
        execute(command)
        end = _now()
        self.collectives = outer
        if type(command) is not wire.Profile:   # the profiler's own pings are not the program's
            self.rows.append((command, start, end, collectives, self._status(command)))

    def finish(self) -> bytes:
        """Stop: the worker's communicators are its own again; the frame of every row."""
        self.comms.comm, self.comms.host_comm = self.unwrapped
        return clock_frame([_row(*kept) for kept in self.rows])

    def _status(self, command) -> str:
        poisoned = self.poisoned
        for tensor_id in _outputs(command):
            origin = poisoned.get(tensor_id)
            if origin is not None:
                return "failed" if origin == command.seq else "poisoned"
        return "ok"


def _row(command, start: int, end: int, collectives: list, status: str) -> tuple:
    name, detail = _describe(command)
    return (command.seq, type(command).__name__, name, detail, start, end - start, status, collectives)


def _describe(command) -> tuple[str, str]:
    """(name, detail) of a command in the trace: the user's op where there is one."""
    kind = type(command)
    if kind is wire.RunOp:
        return command.op, "" if command.kernel == command.op else command.kernel
    if kind is wire.Redistribute:
        return "redistribute", format_steps(command.placements, command.steps)
    if kind is wire.Transfer:
        return "transfer", f"{format_placements(command.src_placements)} -> {format_placements(command.dst_placements)}"
    if kind in (wire.Factory, wire.OptimizerStep, wire.UpdateGrads):
        return command.kind, ""
    if kind is wire.Backward:
        return "backward", command.mode
    if kind in (wire.LoadShard, wire.LoadChunks):
        return kind.__name__, command.name
    return kind.__name__, ""


def _outputs(command) -> tuple:
    if hasattr(command, "out_ids"):
        return command.out_ids
    return (command.out_id,) if hasattr(command, "out_id") else ()


# --- the bytes a rank sends in each collective -------------------------------------------------
# The same ring model as ops.suggest.MOVE_COST (which costs a redistribute before it runs), here
# in terms of the buffer this rank passes: an all-gather sends its piece to n-1 peers, an
# all-reduce is a reduce-scatter then an all-gather, an all-to-all keeps one of its n pieces.
def sent_bytes(kind: str, group_size: int, nbytes: int) -> int:
    n = group_size
    if n <= 1:
        return 0
    factor = {"all_gather": n - 1, "all_reduce": 2 * (n - 1) / n, "agree_max": 2 * (n - 1) / n,
              "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}[kind]
    return round(factor * nbytes)


class RecordingComm:
    """A Communicator that times each collective and counts the bytes this rank sends."""

    def __init__(self, comm, recorder: CommandRecorder):
        self.comm, self.recorder = comm, recorder

    def __getattr__(self, name):   # group, regroup, close, host, ...: the communicator's own
        return getattr(self.comm, name)

    # A failing backward stops the ranks waiting in its collectives through the communicator's
    # abort_key (training.py): set here, it would land on this wrapper, which no collective reads,
    # and the others would wait out the Gloo timeout. AttributeError where the communicator has
    # none (NCCL): hasattr is False, as without the profiler.
    @property
    def abort_key(self):
        return self.comm.abort_key

    @abort_key.setter
    def abort_key(self, key) -> None:
        self.comm.abort_key = key

    def all_reduce(self, ranks, tensor, reduce_op):
        return self._timed("all_reduce", ranks, tensor.nbytes, self.comm.all_reduce, ranks, tensor, reduce_op)

    def all_gather(self, ranks, tensor):
        return self._timed("all_gather", ranks, tensor.nbytes, self.comm.all_gather, ranks, tensor)

    def reduce_scatter(self, ranks, stacked, reduce_op):
        return self._timed("reduce_scatter", ranks, stacked.nbytes, self.comm.reduce_scatter, ranks, stacked, reduce_op)

    def all_to_all(self, ranks, send):
        return self._timed("all_to_all", ranks, send.nbytes, self.comm.all_to_all, ranks, send)

    def agree_max(self, ranks, value):
        return self._timed("agree_max", ranks, 8, self.comm.agree_max, ranks, value)

    def exchange(self, ranks, sends, receives):
        start = _now()
        try:
            return self.comm.exchange(ranks, sends, receives)
        finally:
            sent = sum(tensor.nbytes for _, tensor in sends)
            self.recorder.collectives.append(("exchange", tuple(ranks), sent, start, _now() - start))

    def _timed(self, kind: str, ranks, nbytes: int, call, *args):
        start = _now()
        try:
            return call(*args)
        finally:
            self.recorder.collectives.append(
                (kind, tuple(ranks), sent_bytes(kind, len(ranks), nbytes), start, _now() - start))
