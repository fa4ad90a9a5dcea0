"""The controller's side of dtorch.profile: spans recorded in this process, and the Profile
command's round trips that turn workers' recording on and off and align their clocks.

`active` is the recorder while a profile is on, else None. Every hook (an op's issue, a flush,
a read, backward, an optimizer step) reads it once and does nothing more when it is None, so
profiling off costs one global lookup per hooked call. dtorch/profile/ starts and stops it and
writes the trace; this module only records.

Clocks: every span is in time.perf_counter_ns(), which on Linux is CLOCK_MONOTONIC, one clock
for every process of a host. Workers on other hosts have their own: a clock ping (Profile with
on=True) carries the worker's time back, and the offset worker - controller is estimated as
worker_time - (sent + received) / 2, off by at most half the round trip; the ping with the
shortest round trip of several is kept.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import NamedTuple

from ...errors import ProtocolError, format_site, user_frame
from .. import protocol as wire
from .reads import Future, _Read

__all__ = ["active", "ControllerRecorder", "span", "ClockReading", "ping_workers", "LOOP", "READS"]

now = time.perf_counter_ns
LOOP, READS = "loop", "reads"   # lanes besides the user's threads: the controller's loop, reads in flight
active: ControllerRecorder | None = None
_NOTHING = contextlib.nullcontext()


class ControllerRecorder:
    """Spans of this process: (name, category, lane, start_ns, end_ns, args). A lane is a
    thread ident (the user's threads), LOOP or READS. list.append is atomic: any thread may add."""

    def __init__(self):
        self.events: list = []
        self.thread_names: dict[int, str] = {}

    def add(self, name: str, category: str, lane, start: int, end: int, args: dict | None = None) -> None:
        self.events.append((name, category, lane, start, end, args or {}))

    def user_span(self, name: str, category: str, **args) -> _UserSpan:
        thread = threading.current_thread()
        self.thread_names.setdefault(thread.ident, thread.name)
        return _UserSpan(self, name, category, thread.ident, args)

    def read_issued(self, future: Future, what: str) -> None:
        """A read from now until its future resolves (on the loop thread, or at once if done)."""
        start, site = now(), format_site(user_frame())
        future._inner.add_done_callback(
            lambda done: self.add("read", "read", READS, start, now(),
                                  {"tensor": what, "site": site, "failed": done.exception() is not None}))


class _UserSpan:
    """A span on the calling thread, with the user's line; kept even if the call raises."""
    __slots__ = ("recorder", "name", "category", "lane", "args", "start")

    def __init__(self, recorder, name, category, lane, args):
        self.recorder, self.name, self.category, self.lane, self.args = recorder, name, category, lane, args

    def __enter__(self):
        self.args["site"] = format_site(user_frame())
        self.start = now()
        return self

    def __exit__(self, error_type, error, tb) -> None:
        if error_type is not None:
            self.args["raised"] = error_type.__name__
        self.recorder.add(self.name, self.category, self.lane, self.start, now(), self.args)


def span(name: str, category: str = "call", **args):
    """A span around a user-facing call (backward, an optimizer step, ...) while profiling is on."""
    recorder = active
    return _NOTHING if recorder is None else recorder.user_span(name, category, **args)


# --- the Profile round trips -------------------------------------------------------------------
class ClockReading(NamedTuple):
    sent: int       # controller clock when the command was issued
    received: int   # controller clock when this rank's reply arrived
    payload: tuple  # (worker clock,) or (worker clock, rows)

    @property
    def offset(self) -> float:
        """worker clock - controller clock, estimated from this round trip."""
        return self.payload[0] - (self.sent + self.received) / 2

    @property
    def round_trip(self) -> int:
        return self.received - self.sent


def ping_workers(controller, on: bool, timeout: float | None, wait: bool = True) -> dict[int, ClockReading]:
    """Issue one Profile command to every live worker and wait for every reply (or not)."""
    future = controller.new_future()   # replies taken by this thread as they arrive: exact times
    read = ProfileRead(controller.pool.live_ranks(), future)
    controller.submit(wire.Profile, on, read=read)
    if not wait:
        controller.receiver.wake_receiver()   # nobody blocks on it: the loop thread takes the replies
        return {}
    frames = future.result(timeout)
    return {rank: ClockReading(read.sent, read.arrived[rank], _decode(rank, frame)) for rank, frame in frames.items()}


def _decode(rank: int, frame: bytes) -> tuple:
    payload = wire.unpack(frame)
    if type(payload) is not tuple or not payload or type(payload[0]) is not int:
        raise ProtocolError(f"rank {rank} answered Profile with {wire.clip(payload)}")
    return payload


class ProfileRead(_Read):
    """The replies to one Profile command: one frame per rank, and when each arrived."""

    def __init__(self, ranks, future: Future):
        super().__init__(ranks, future)
        self.arrived: dict[int, int] = {}
        self.sent = now()

    def check(self, rank: int, status: str, frames: list) -> str | None:
        if status == "ok" and len(frames) == 1:
            return None
        return f"status {status[:40]!r} with {len(frames)} frame(s) where a Profile reply has one"

    def add(self, rank: int, status: str, origin: int, frames: list) -> bool:
        self.arrived[rank] = now()
        return super().add(rank, status, origin, frames)

    def finish(self, failures) -> bool:
        self.succeed({rank: frames[0].bytes for rank, frames in self.frames.items()})
        return True
