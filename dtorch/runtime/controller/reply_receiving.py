"""Who takes the workers' messages off the controller's ROUTER socket, and when.

A thread that blocks on a read takes them itself (receive_here), for up to READER_RECEIVE_S,
so that its reply wakes that thread alone, not the loop thread first. The loop thread, finding
the socket taken, stops watching it (its descriptor stays readable until the holder drains it:
watching would spin) and watches it again when something needs replies that no thread blocks on
(wake_receiver: an awaited or polled future, a pending read, joining workers). Whoever holds the
ROUTER lock runs the handlers of worker_messages.py.

ReplyReceiver is owned by the Controller and given to every read's Future, which calls
`wait_for` and `wake_receiver`. It takes the loop and its thread, the sockets, the message
handlers, the session's reads and its pool; of the controller it reads `_Stream`. The watchdog
(lost_workers.py) takes the socket through `held_by_watchdog` and reports its ticks in
`loop_ticked`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time
import traceback
from typing import Protocol

from ...errors import DTorchError, ProtocolError
from . import interrupts
from ..transport import ControllerSockets
from .cluster import WorkerPool
from .reads import ReadBook, wait_done
from .worker_messages import WorkerMessages

__all__ = ["ReplyReceiver", "READER_RECEIVE_S", "READ_SPIN_S", "WAIT_SLICE_S"]

# A thread blocked on a read takes replies off the ROUTER itself for up to this long, then hands
# the socket back to the loop thread: the reply wakes only the thread that waits for it, not the
# loop thread first (125 us less per read, benchmark 3), and the loop's watchdog waits at most
# this long for the socket.
READER_RECEIVE_S = 0.02

# A blocking read spins for its reply, for up to READ_SPIN_S, before it sleeps, when the reply is
# likely that close: every worker is idle (each has answered a read issued after the last command
# that gives them work), or the last SHORT_WAITS_TO_SPIN blocking reads each had their reply within
# READ_SPIN_S. A thread that sleeps for a reply wakes on cold caches, and so runs the reply's
# handling and the next call slowly (benchmark 3). A read that waits for work does not spin: the
# spinning thread would take a core from the workers (a matmul chain then .item() took 1.3 -> 1.9
# ms on 1 worker on 2 cores when every read spun). Two short waits, not one: a step that logs two
# values (`loss.item()`, the workers busy, then `norm.item()`, idle, so short) would otherwise
# spin in vain at every step's first read. This is spin-then-block with the adaptive rule of
# spinning mutexes: spin where spinning paid lately.
SHORT_WAITS_TO_SPIN = 2
READ_SPIN_S = 0.0005

# A blocking wait looks up from its reply this often: to run a Ctrl-C deferred meanwhile
# (interrupts.py), and to do the watchdog's work for its own read when the loop thread has not
# ticked for LOOP_QUIET_S (a worker process that exited fails the read), or fail it outright
# once that thread has been stuck for the controller's loop_stuck_s: a read never waits forever
# on a thread that cannot answer.
WAIT_SLICE_S = 0.05
LOOP_QUIET_S = 1.0


class _Stream(Protocol):
    """What the receiver reads of the controller: whether the sockets are still open, and the
    last command that gives the workers work (a read right after it waits for that work)."""
    sockets_open: bool
    last_work_seq: int


class ReplyReceiver:
    def __init__(self, stream: _Stream, loop: asyncio.AbstractEventLoop, loop_thread: threading.Thread,
                 sockets: ControllerSockets, messages: WorkerMessages, reads: ReadBook, pool: WorkerPool,
                 loop_stuck_s: float):
        self._stream, self._loop, self._thread, self.sockets = stream, loop, loop_thread, sockets
        self._messages, self._reads, self._pool = messages, reads, pool
        self.loop_stuck_s = loop_stuck_s
        # Whoever holds the ROUTER lock drains the ROUTER and runs the message handlers: the loop
        # thread, or a thread blocked on a read (receive_here). _receive_wanted: the loop thread
        # found it taken and stopped watching the socket until someone needs it again
        # (wake_receiver); its watchdog drains the socket meanwhile (heartbeats).
        self._router_lock = threading.Lock()
        self._receive_wanted = False
        self.watching = False            # the loop thread watches the socket (loop thread only)
        self._watchdog_waiting = False   # reading threads leave the socket to the loop's watchdog
        self.loop_ticked = time.monotonic()   # the watchdog's latest tick (reads supervise without it)
        self._short_waits = 0      # the last blocking reads in a row whose reply came within READ_SPIN_S
        self.reads_spun = 0

    def watch(self) -> None:
        self._loop.add_reader(self.sockets.reply_fd, self._receive)
        self.watching = True

    def _receive(self) -> None:
        """The ROUTER's descriptor is readable: handle everything queued, then wait again. If a
        reading thread holds the socket, stop watching it (its descriptor stays readable until
        that thread drains it: watching would spin), until wake_receiver."""
        self._receive_wanted = True   # before the attempt: a holder that releases now sees it
        if not self._router_lock.acquire(blocking=False):
            if self.watching:
                self._loop.remove_reader(self.sockets.reply_fd)
                self.watching = False
            return
        try:
            self._receive_wanted = False
            if self._stream.sockets_open:
                self._handle_queued()
        finally:
            self._router_lock.release()

    def _resume_receiving(self) -> None:
        if not self._stream.sockets_open:
            return
        if not self.watching:
            self.watch()
        self._receive()

    def wake_receiver(self) -> None:
        """Any thread: replies are needed without a thread blocked on them (an awaited or polled
        future, a pending read, joining workers): if a reading thread had taken the socket from
        the loop thread, the loop thread watches it again."""
        if self._receive_wanted:
            try:
                self._loop.call_soon_threadsafe(self._resume_receiving)
            except RuntimeError:   # the loop has stopped: the session is over
                pass

    def wait_for(self, reply: concurrent.futures.Future, timeout: float | None) -> None:
        """Block until `reply` is done or `timeout` passes, taking replies off the socket on this
        thread when it is free (receive_here). Between slices: a deferred Ctrl-C is raised here,
        where nothing is held, and the read is supervised without the loop thread."""
        interrupts.install()   # a flag test, once installed (a session started on another thread)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not reply.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self.receive_here(reply, left)
            if not reply.done():
                wait_done(reply, WAIT_SLICE_S if left is None else min(left, WAIT_SLICE_S))
            if not reply.done():
                if self._reads.pending:
                    self.wake_receiver()
                interrupts.raise_pending()
                self._supervise_read(reply)

    def _supervise_read(self, reply: concurrent.futures.Future) -> None:
        """What the watchdog would do for this read, when the loop thread has not run it lately."""
        quiet = time.monotonic() - self.loop_ticked
        if quiet < LOOP_QUIET_S:
            return
        read = next((r for r in list(self._reads.pending.values()) if r.future._inner is reply), None)
        if read is None:
            return
        lost = self._pool.exited(read.waiting)
        if lost is not None:
            read.fail(lost)
        elif quiet > self.loop_stuck_s:
            read.fail(DTorchError(f"dtorch's controller loop thread has not run for {quiet:.0f}s (the limit is "
                                  f"loop_stuck_s={self.loop_stuck_s:g}s, DTORCH_LOOP_STUCK_S), so this read cannot "
                                  f"complete; that thread is at:\n{self.loop_thread_stack()}"))

    def describe(self) -> str:
        """Who has the socket now (a hung session's diagnosis)."""
        return (f"router lock held {self._router_lock.locked()}, receive wanted {self._receive_wanted}, "
                f"loop watching {self.watching}, watchdog waiting {self._watchdog_waiting}")

    def loop_thread_stack(self) -> str:
        frame = sys._current_frames().get(self._thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    def receive_here(self, reply: concurrent.futures.Future, timeout: float | None) -> None:
        """Called by a thread about to block on a read: it takes messages off the ROUTER and
        handles them itself until its reply is in (or READER_RECEIVE_S passes), so that the
        reply wakes this thread alone instead of the loop thread and then this one. When the loop
        thread or another reading thread holds the socket, this one simply waits."""
        if (self._watchdog_waiting or threading.current_thread() is self._thread
                or not self._router_lock.acquire(blocking=False)):
            return
        try:
            started = time.monotonic()
            deadline = started + (READER_RECEIVE_S if timeout is None else min(timeout, READER_RECEIVE_S))
            spin = self._short_waits >= SHORT_WAITS_TO_SPIN or self._stream.last_work_seq < self._reads.idle_upto
            spin_until = min(deadline, started + READ_SPIN_S) if spin else 0.0
            self.reads_spun += spin
            while self._stream.sockets_open and not reply.done() and not interrupts.pending():
                now = time.monotonic()
                if now >= deadline:
                    break
                if not (now < spin_until and self.sockets.spin_for_reply(spin_until)):
                    if not self.sockets.wait_for_reply(deadline - time.monotonic()):
                        break
                self._handle_queued()
            short = reply.done() and time.monotonic() - started < READ_SPIN_S
            self._short_waits = min(self._short_waits + 1, SHORT_WAITS_TO_SPIN) if short else 0
        finally:
            self._router_lock.release()
            if self._reads.pending:   # this thread's read if it gave up (or was interrupted), or others'
                self.wake_receiver()

    @contextlib.contextmanager
    def held_by_watchdog(self):
        """The watchdog's turn on the socket: reading threads stop taking it (no starvation), and
        everything queued is handled (heartbeats count before silence is judged)."""
        self._watchdog_waiting = True
        with self._router_lock:
            self._watchdog_waiting = False
            if self._stream.sockets_open:
                self._handle_queued()
            yield

    @contextlib.contextmanager
    def held(self):
        """The socket for the caller (shutdown): everything queued is handled first."""
        with self._router_lock:
            self._handle_queued()
            yield

    def stop_watching(self) -> None:
        """Loop thread, as the sockets close."""
        if self.watching:
            self._loop.remove_reader(self.sockets.reply_fd)
            self.watching = False

    def _handle_queued(self) -> None:
        """ROUTER lock held: handle every message queued on the ROUTER."""
        for identity, header, data in self.sockets.drain():
            try:
                self._messages.on_message(identity, header, data)
            except ProtocolError as error:
                self._messages.reject(identity, str(error))
            except Exception:  # a bug in one handler must not stop the loop
                traceback.print_exc()

