"""Who takes the workers' messages off the controller's ROUTER socket, and when.

A thread that blocks on a read takes them itself (receive_here), for up to READER_RECEIVE_S,
so that its reply wakes that thread alone, not the loop thread first. The loop thread, finding
the socket taken, stops watching it (its descriptor stays readable until the holder drains it:
watching would spin) and watches it again when something needs replies that no thread blocks on
(wake_receiver: an awaited or polled future, a pending read, joining workers). Whoever holds the
ROUTER lock runs the handlers of worker_messages.py.

A mixin of Controller (controller.py), which provides what these methods use: `sockets`,
`_loop` and `_thread`, `_router_lock`, `_receive_wanted`, `_watching_replies`,
`_watchdog_waiting`, `_sockets_open`, `_reads`, `_last_work_seq`, `_idle_upto`, `_short_waits`,
`reads_spun`, and `_on_message` and `_reject` (worker_messages.py).
"""
from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
import traceback

from ...errors import DTorchError, ProtocolError
from . import interrupts
from .reads import wait_done

__all__ = ["ReplyReceiving", "READER_RECEIVE_S", "READ_SPIN_S", "WAIT_SLICE_S"]

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


class ReplyReceiving:
    def _watch_replies(self) -> None:
        self._loop.add_reader(self.sockets.reply_fd, self._receive)
        self._watching_replies = True

    def _receive(self) -> None:
        """The ROUTER's descriptor is readable: handle everything queued, then wait again. If a
        reading thread holds the socket, stop watching it (its descriptor stays readable until
        that thread drains it: watching would spin), until wake_receiver."""
        self._receive_wanted = True   # before the attempt: a holder that releases now sees it
        if not self._router_lock.acquire(blocking=False):
            if self._watching_replies:
                self._loop.remove_reader(self.sockets.reply_fd)
                self._watching_replies = False
            return
        try:
            self._receive_wanted = False
            if self._sockets_open:
                self._handle_queued()
        finally:
            self._router_lock.release()

    def _resume_receiving(self) -> None:
        if not self._sockets_open:
            return
        if not self._watching_replies:
            self._watch_replies()
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
                if self._reads:
                    self.wake_receiver()
                interrupts.raise_pending()
                self._supervise_read(reply)

    def _supervise_read(self, reply: concurrent.futures.Future) -> None:
        """What the watchdog would do for this read, when the loop thread has not run it lately."""
        quiet = time.monotonic() - self._loop_ticked
        if quiet < LOOP_QUIET_S:
            return
        read = next((r for r in list(self._reads.values()) if r.future._inner is reply), None)
        if read is None:
            return
        lost = self.pool.exited(read.waiting)
        if lost is not None:
            read.fail(lost)
        elif quiet > self.loop_stuck_s:
            read.fail(DTorchError(f"dtorch's controller loop thread has not run for {quiet:.0f}s (the limit is "
                                  f"loop_stuck_s={self.loop_stuck_s:g}s, DTORCH_LOOP_STUCK_S), so this read cannot "
                                  f"complete; that thread is at:\n{self.loop_thread_stack()}"))

    def loop_thread_stack(self) -> str:
        frame = sys._current_frames().get(self._thread.ident)
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
            spin = self._short_waits >= SHORT_WAITS_TO_SPIN or self._last_work_seq < self._idle_upto
            spin_until = min(deadline, started + READ_SPIN_S) if spin else 0.0
            self.reads_spun += spin
            while self._sockets_open and not reply.done() and not interrupts.pending():
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
            if self._reads:   # this thread's read if it gave up (or was interrupted), or others'
                self.wake_receiver()

    def _handle_queued(self) -> None:
        """ROUTER lock held: handle every message queued on the ROUTER."""
        for identity, header, data in self.sockets.drain():
            try:
                self._on_message(identity, header, data)
            except ProtocolError as error:
                self._reject(identity, str(error))
            except Exception:  # a bug in one handler must not stop the loop
                traceback.print_exc()

