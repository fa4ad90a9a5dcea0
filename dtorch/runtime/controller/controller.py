"""The controller: an asyncio event loop on a thread dtorch owns, plus the few calls the user's
thread makes into it.

User thread                          loop thread
  submit(Command, ...) -> seq  ─┐      _flush: one PUB message per batch of commands
  (append under a lock; the     ├──▶   _receive: registrations, replies, errors, heartbeats
   first append schedules a     │      watch: process exits, heartbeat silence, idle frees
   flush: no wait on a worker) ─┘
  fetch() -> Future  ◀───────────────  resolved when the last reply arrives (no polling)

A thread that blocks on a read publishes it itself and takes the replies off the socket itself
(receive_here), so that the reply wakes that thread alone; the loop thread then stops watching the
socket until an awaited or polled future needs it again (wake_receiver).

Commands are numbered; the loop publishes them in order; workers check the numbering. The
Controller is the command stream; it owns one component per other idea, each with what it needs
given in its constructor:

  reads      reads.ReadBook              the reads the workers owe, the failures they reported
  meshes     meshes.MeshBook             mesh ids, meshes a loss retired, the regroup
  pool       cluster.WorkerPool          the worker records: starting, registered, lost
  messages   worker_messages.WorkerMessages   a handler per message a worker sends
  receiver   reply_receiving.ReplyReceiver    who takes those off the socket, and when
  lost_workers  lost_workers.LostWorkers      the watchdog and what a loss fails
  sites      command_sites.CommandSites  the user's line of each recent command

What the frontend keeps per session (dtorch.compile's capture, dtorch.utils.checkpoint's
regions, the counts of its own work) stays in the frontend (dtensor/frontend_state.py,
dtensor/compile_capture.py); a capture sees each command through `tap`, a CommandTap.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Protocol

from ...errors import (SessionEndedError, UnreadFailureWarning, format_site, user_frame,
                       user_position)
from . import interrupts, profiling
from .. import protocol as wire
from .admission import Rejections, new_secret
from .reads import FetchRead, Future, ReadBook, RemoteFailure, SyncRead, wait_interruptibly
from .rendezvous import host_store
from .cluster import WorkerPool, WorkerRecord
from .command_sites import SITE_RING, CommandSites
from .lost_workers import LostWorkers
from .meshes import MeshBook
from .reply_receiving import ReplyReceiver
from .worker_messages import WorkerMessages
from ..transport import LOCAL, ControllerSockets, CurveKeys

__all__ = ["Controller", "CommandTap", "WorkerRecord"]

# Batching: a read flushes at once; otherwise commands leave after a short idle, when a batch is
# full, or, while the user's thread keeps issuing, once the oldest pending command has waited
# AGED_FLUSH_S: that thread publishes the batch itself, since the loop thread's idle flush waits
# for the GIL, which a thread issuing ops holds for up to the 5 ms switch interval at a time (the
# workers sat idle until a whole training step had been issued). 2 ms keeps batches at ~150
# commands (0.5 ms cost 1 us more controller CPU per op, for batches of ~50). Dropped symbols are
# freed FREE_BATCH at a time, in program order (and at every flush).
# The idle flush is one timer on the loop thread that stays armed while the user's thread issues:
# it looks again every BUSY_RECHECK_S until IDLE_FLUSH_S pass without a command. (A wake-up of
# the loop thread per batch cost the issuing thread ~20% of its time in GIL hand-offs.)
# A batch also leaves, from the issuing thread, once it holds WORK_FLUSH_ROWS commands' worth of
# work (a RunGraph counts each row it replays): calls of a compiled function come ~15 us apart
# and each is a whole graph, so waiting 2 ms for the first batch kept the workers idle while ~150
# calls piled up; at ~10 calls of a 100-row graph a batch still spreads a message's cost thin.
IDLE_FLUSH_S = 0.0005
AGED_FLUSH_S = 0.002
WORK_FLUSH_ROWS = 1024
BUSY_RECHECK_S = 0.001
BATCH_LIMIT = 4096
FREE_BATCH = 16
# ... except a dropped symbol whose block on each worker is this large: its Free goes before the
# next command, so a chain of large temporaries (an activation per layer) does not keep up to 16
# dead buffers on every worker.
FREE_AT_ONCE_BYTES = 1 << 20
STALE_PENDING_S = 0.1   # the watchdog publishes commands pending this long (no timer did: a safety net)
HANG_TIMEOUT_S = 600.0   # one command running longer than this on a worker: reported lost and ended
# Shutdown: workers finish what was issued; after SHUTDOWN_QUIET_S of waiting it says for whom.
# Leaving on a Ctrl-C, it says so at once and ends them after INTERRUPTED_EXIT_S.
SHUTDOWN_QUIET_S = 1.0
INTERRUPTED_EXIT_S = 1.0
LOOP_STUCK_S = 30.0      # a blocking read fails once the loop thread has not run for this long
CLOSE_TIMEOUT_S = 5.0    # shutdown waits this long for the loop thread to close the sockets
# Tensor ids are unique across sessions in this process, so a tensor kept from an ended session
# can never name a tensor of the next one, even where the ownership check is bypassed.
_TENSOR_IDS = itertools.count(1)
_PROBE = wire.encode(wire.Probe())


class CommandTap(Protocol):
    """What sees every command as it is submitted, while one is set (`Controller.tap`): the
    capture of a dtorch.compile call (dtensor/compile_capture.py). Both run on the submitting
    thread, before and under the submit lock."""

    def check(self, command_type, site, read, private) -> None:
        """Before the command is numbered: raise to refuse it."""

    def record(self, command, site) -> None:
        """The numbered command (a Free the controller adds has no site: None)."""


class Controller:
    def __init__(self, bind_host: str | None = LOCAL, curve: CurveKeys | None = None,
                 gloo_timeout_s: float = 120.0, hang_timeout_s: float | None = None):
        """bind_host: the address workers on other hosts reach; LOCAL (None) for a session on
        this machine only (private ipc sockets, the rendezvous store on 127.0.0.1).
        hang_timeout_s: a worker running one command longer than this is reported lost and ended
        (default: DTORCH_HANG_TIMEOUT_S, else HANG_TIMEOUT_S; 0 turns it off)."""
        interrupts.install(again=True)   # a Ctrl-C inside dtorch's code waits for it to return (interrupts.py)
        # First: an address that is not this machine's fails here, before any thread is started.
        self.store, self.store_address = host_store(bind_host or "127.0.0.1", gloo_timeout_s)
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()   # taken before _lock, never inside it
        self._pending: list = []
        self._private: dict[int, list] = {}
        self._released: collections.deque = collections.deque()
        self._free_now = False   # a large block was dropped: free before the next command
        self._next_seq = 0
        self.published_upto = 0
        self._flush_scheduled = False   # the idle-flush timer is armed (it disarms only when idle)
        self._flush_now = False         # an immediate flush (a full batch) is on its way
        self._pending_since = 0.0       # when the oldest pending command was submitted (monotonic)
        self._pending_rows = 0          # the pending commands' spans: rows of work (a RunGraph, each it replays)
        self._last_submit = 0.0         # when the newest command was submitted (monotonic)
        self.sites = CommandSites()     # the user's line that issued each recent command (errors)
        # submit writes the ring's columns directly, for every command (command_sites.CommandSites)
        self._site_seqs, self._site_codes = self.sites.seqs, self.sites.codes
        self._site_offsets, self._site_whats = self.sites.offsets, self.sites.whats
        self.reads = ReadBook()   # the reads the workers owe, and the failures they reported
        self.last_work_seq = -1   # the last submitted command other than a read (a Free is not work)
        self.commands_sent = self.batches_sent = 0
        self.gloo_timeout_s = gloo_timeout_s
        self.hang_timeout_s = (float(os.environ.get("DTORCH_HANG_TIMEOUT_S", HANG_TIMEOUT_S))
                               if hang_timeout_s is None else hang_timeout_s)
        self.share_gpu = False   # shared-GPU mode (session.init's share_gpu; runtime/devices/shared_gpu.py)
        self.closed = False
        self.tap: CommandTap | None = None   # dtorch.compile's capture in progress, else None
        self._release_watch: dict[int, weakref.WeakSet] = {}   # id -> graphs that read it (watch_release)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dtorch-controller", daemon=True)
        self._thread.start()
        self.curve = curve
        self.secret = new_secret()      # travels to workers on their stdin, back in REGISTER
        self.rejections = Rejections()
        self.sockets_open = False
        # the pool before the sockets: opening them starts the loop's watchdog, which reads it
        self.pool = WorkerPool(self._lock, self.store)
        self.workers = self.pool.workers    # rank -> WorkerRecord
        self.meshes = MeshBook(self.pool, self.submit, self.new_id)
        self.define_mesh = self.meshes.define   # the id of a mesh, defined on the workers the first time
        self.lost_workers = LostWorkers(self, self.pool, self.meshes, self.reads, self.sites)
        self.sockets = self._call(self._open, bind_host, curve)

    # --- user thread ----------------------------------------------------------------------------
    def submit(self, command_type, *fields, read=None, private=None, span=1) -> int:
        """Append one command; returns its seq. Never waits on a worker. `span`: the seqs it
        takes (a RunGraph takes one per replayed command)."""
        site = user_position(skip=2)   # skip submit and whichever dtorch function called it
        if self.closed:
            raise SessionEndedError(f"at {format_site(site)}: this tensor or call belongs to a dtorch session "
                                    "that has ended (dtorch.shutdown()); its data went with that session's "
                                    "workers: build it again in the current session")
        tap = self.tap
        if tap is not None:   # dtorch.compile's first call: refuses reads and uploads (raises)
            tap.check(command_type, site, read, private)
        now = time.monotonic()
        with self._lock:
            if not self._pending:   # (before the Free that may go first: it starts the batch as much)
                self._pending_since = now
            self._pending_rows += span
            if self._free_now or len(self._released) >= FREE_BATCH:
                self._free_released()
            seq = self._next_seq
            self._next_seq = seq + span
            command = command_type(seq, *fields)
            self._last_submit = now
            self._pending.append(command)
            if tap is not None:
                tap.record(command, site)
            slot = seq % SITE_RING
            self._site_seqs[slot] = seq
            if site is None:
                self._site_codes[slot] = None
            else:
                self._site_codes[slot], self._site_offsets[slot] = site
            self._site_whats[slot] = fields[2] if command_type is wire.RunOp else command_type
            if private is not None:
                self._private[seq] = private
            if read is not None:
                self.reads.pending[seq] = read
            else:
                self.last_work_seq = seq   # a read (Fetch, Sync) is not work that keeps workers busy
                if len(self._pending) >= BATCH_LIMIT:
                    if not self._flush_now:
                        self._flush_now = True
                        self._loop.call_soon_threadsafe(self._flush)
                elif not self._flush_scheduled:
                    self._flush_scheduled = True
                    self._loop.call_soon_threadsafe(self._flush_soon)
        if read is not None or now - self._pending_since >= AGED_FLUSH_S or self._pending_rows >= WORK_FLUSH_ROWS:
            self._flush()   # from this thread: a read, a batch that waited or one with work enough: no loop wake-up
        return seq

    def reference(self, tensor) -> wire.WireRef:
        """The wire reference to `tensor` as an op input; it must belong to this session."""
        if tensor._controller is not self:
            raise SessionEndedError(f"at {format_site(user_frame(skip=1))}: an input of this call, {tensor!r}, "
                                    "belongs to a dtorch session that has ended (dtorch.shutdown()); its "
                                    "data went with that session's workers: build it again in this session")
        meshes = self.meshes
        if tensor._id < meshes.first_valid_id:   # inline: this runs for every input of every op
            meshes.lost_tensors.check(tensor)
        return wire.wire_ref(tensor._id)

    def check_current(self, tensor) -> None:
        """Refuse a tensor whose data went with a lost, since replaced, worker (LostTensorError)."""
        self.meshes.check_current(tensor)

    def curve_for_worker(self) -> dict | None:
        return self.curve.for_worker() if self.curve is not None else None

    def _free_released(self) -> None:
        """Lock held: one Free for the symbols dropped since the last command, placed before the
        next command so workers free buffers in program order (not once per batch)."""
        self._free_now = False
        ids = tuple([self._released.popleft() for _ in range(len(self._released))])
        if not ids:
            return
        free = wire.Free(self._next_seq, ids)
        self._pending.append(free)
        # A Free has no line of its own: its ring slot must not answer for the command SITE_RING
        # seqs older (command_sites.CommandSites.forget)
        self._site_seqs[free.seq % SITE_RING] = -1
        self._next_seq += 1
        if self.tap is not None:
            self.tap.record(free, None)

    def free_before_next(self) -> None:
        """The next command goes after a Free of every id dropped so far. A replay asks for it:
        it writes its graph's persistent ids again, and one of them may have been dropped since
        (a buffer the function updates, changed in place outside it: reset_running_stats). A
        batched Free of that id sent after the replay would free what the replay made."""
        self._free_now = True

    def released_pending(self) -> tuple:
        """Ids dropped but not yet in a Free (dtorch.compile sorts a capture's ids with them)."""
        with self._lock:
            return tuple(self._released)

    @staticmethod
    def new_id() -> int:
        return next(_TENSOR_IDS)

    @staticmethod
    def new_ids(count: int) -> tuple:
        return tuple([next(_TENSOR_IDS) for _ in range(count)])

    def release(self, tensor_id: int, block_bytes: int = 0) -> None:
        """Called from DTensor.__del__ (any thread, any time): a lock-free append. A large block
        asks for its Free before the next command (the flag is read under the lock in submit;
        set after the append, so the Free it asks for holds the id)."""
        self._released.append(tensor_id)
        if block_bytes >= FREE_AT_ONCE_BYTES:
            self._free_now = True
        if self._release_watch:   # dtorch.compile: a graph that reads this id must capture again
            for watcher in self._release_watch.pop(tensor_id, ()):
                watcher.released()

    def watch_release(self, ids, watcher) -> None:
        """Call `watcher.released()` when any of `ids` is released (one dict pop per release).
        Held weakly: a graph dropped from its cache leaves nothing behind but an empty set per id."""
        for tensor_id in ids:
            watchers = self._release_watch.get(tensor_id)
            if watchers is None:
                watchers = self._release_watch[tensor_id] = weakref.WeakSet()
            watchers.add(watcher)

    def new_future(self) -> Future:
        """A read's future; a thread that blocks on it receives the reply itself."""
        return Future(receiver=self.receiver)

    def fetch(self, tensor) -> Future:
        meta = tensor._meta
        mesh = meta.mesh
        future = self.new_future()
        self.check_current(tensor)
        lost = self.pool.lost_among(mesh.ranks)
        if lost:
            future._inner.set_exception(lost)
            return future
        senders = meta.senders()
        read = FetchRead(mesh.ranks, future, meta, senders, tensor._seq)
        self.submit(wire.Fetch, tensor._id, self.define_mesh(mesh), senders, read=read)
        read.prepare()
        if profiling.active is not None:
            profiling.active.read_issued(future, meta.describe())
        return future

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every live worker has run everything issued so far; raise the first remote
        failure no read has raised yet."""
        future = self.new_future()
        self.submit(wire.Sync, read=SyncRead(self.pool.live_ranks(), future))
        with profiling.span("synchronize", "read"):
            future.result(timeout)
        lost = self.pool.lost_among(self.workers)
        if lost:
            raise lost
        for failure in self.reads.unread_failures():
            raise failure.error(failure.seq)

    def stats(self) -> dict:
        """The controller's part of dtorch.stats(): what it sent and received, and what waits."""
        s = self.sockets
        return {"commands_sent": self.commands_sent, "batches_sent": self.batches_sent,
                "messages_sent": s.messages_sent, "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
                "workers": len(self.workers), "pending_reads": len(self.reads.pending),
                "reads_spun": self.receiver.reads_spun, "messages_rejected": self.rejections.count}

    # --- worker pool ----------------------------------------------------------------------------
    def add_workers(self, handles: list, device: str) -> None:
        self.pool.add(handles, device)
        self.receiver.wake_receiver()   # their registrations must not wait for the next read
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._probe()))

    def wait_registered(self, ranks, timeout: float, progress=None) -> None:
        self.pool.wait_registered(ranks, timeout, progress)

    # --- shutdown -------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the workers, fail every read still pending, and warn about failures never read.
        Leaving on a Ctrl-C (the interpreter's exit after an uncaught KeyboardInterrupt), busy
        workers get INTERRUPTED_EXIT_S, not `timeout`, and are told of at once."""
        if self.closed:
            return
        self.submit(wire.Shutdown)
        self.closed = True
        interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
        wait_s = min(timeout, INTERRUPTED_EXIT_S) if interrupted else timeout
        self.pool.stop_all(time.monotonic() + wait_s, 0.0 if interrupted else SHUTDOWN_QUIET_S,
                           self._describe_busy)
        try:
            self._call(self._close, timeout=CLOSE_TIMEOUT_S)
        except TimeoutError:   # a stuck loop thread (a handler that never returns): its sockets go with the process
            print(f"dtorch: shutdown: the controller's loop thread did not answer within {CLOSE_TIMEOUT_S:g}s; "
                  f"leaving without it. It is at:\n{self.receiver.loop_thread_stack()}", file=sys.stderr, flush=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._fail_pending_reads()
        self._warn_unread_failures()

    def _describe_busy(self, worker: WorkerRecord) -> str:
        if worker.busy_seq < 0:   # from its latest heartbeat (every 0.5 s)
            return f"rank {worker.rank}: running the commands issued before the shutdown"
        return f"rank {worker.rank}: in {self.sites.describe(worker.busy_seq)} at its last heartbeat"

    def _fail_pending_reads(self) -> None:
        self.reads.fail_all(SessionEndedError("the dtorch session was shut down before this read finished"))

    def _warn_unread_failures(self) -> None:
        # A PeerLostError only follows a lost worker, which WorkerLostError already reports.
        unread = [f for f in self.reads.unread_failures() if f.exception_type != "PeerLostError"]
        for failure in unread:
            warnings.warn(f"dtorch: a command failed and no read or synchronize() raised it before shutdown: "
                          f"{failure.error(failure.seq)}", UnreadFailureWarning, stacklevel=3)

    # --- loop thread ----------------------------------------------------------------------------
    def _call(self, fn, *args, timeout: float = 30.0):
        """Run fn on the loop thread and wait for its result (set-up and tear-down only)."""
        async def run():
            return fn(*args)
        done = asyncio.run_coroutine_threadsafe(run(), self._loop)
        wait_interruptibly(done, timeout)
        return done.result(0)

    def _open(self, bind_host, curve) -> ControllerSockets:
        """Loop thread: the sockets, and the components that use them."""
        sockets = ControllerSockets(bind_host, curve)
        self.messages = WorkerMessages(self, sockets, self.pool, self.reads, self.sites, self.rejections,
                                       self.lost_workers.lose)
        self.receiver = ReplyReceiver(self, self._loop, self._thread, sockets, self.messages, self.reads, self.pool,
                                      float(os.environ.get("DTORCH_LOOP_STUCK_S", LOOP_STUCK_S)))
        self.sockets_open = True
        self.receiver.watch()
        self._tasks = [self._loop.create_task(self.lost_workers.watch(self.receiver))]
        return sockets

    def _close(self) -> None:
        self._flush()   # the Shutdown command, if its idle flush has not fired yet
        with self.receiver.held():   # errors the workers sent before they exited are handled first
            with self._publish_lock:   # no reading thread is publishing as the sockets close
                self.sockets_open = False
        self.receiver.stop_watching()
        # Every task of the loop, not only _tasks: a _probe that add_workers started still sleeps
        # when a start fails, and a task left pending as the loop stops is reported at exit as
        # "Task was destroyed but it is pending!". Each cancellation runs before the loop's stop,
        # which shutdown() queues after this call returns.
        for task in asyncio.all_tasks(self._loop) - {asyncio.current_task(self._loop)}:
            task.cancel()
        self.sockets.close()

    def _flush_soon(self) -> None:
        """Arm the idle-flush timer (the first command after the timer disarmed asks for it)."""
        self._loop.call_later(IDLE_FLUSH_S, self._flush_if_idle)

    def _flush_if_idle(self) -> None:
        """Publish once no command came for IDLE_FLUSH_S; while commands keep coming, look again
        later (the issuing thread publishes aged batches itself) without being woken per batch."""
        with self._lock:
            quiet = time.monotonic() - self._last_submit
            if quiet < IDLE_FLUSH_S:
                self._loop.call_later(max(IDLE_FLUSH_S - quiet, BUSY_RECHECK_S), self._flush_if_idle)
                return
            self._flush_scheduled = False   # the next command arms it again
            if not self._pending and not self._released:
                return
        self._flush()

    def flush_stale(self) -> None:
        """Publish dropped ids, or commands pending past STALE_PENDING_S that no timer published:
        the watchdog's safety net, each tick."""
        stale = self._pending and time.monotonic() - self._pending_since > STALE_PENDING_S
        if stale or (self._released and not self._flush_scheduled):
            self._flush()

    def _flush(self) -> None:
        """Publish what is pending. The loop thread runs it after a short idle; a thread that
        issues a read runs it itself. The publish lock keeps batches in seq order on the PUB
        socket (and one thread on it at a time, as ZeroMQ requires)."""
        with self._publish_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self.sockets_open:   # a flush scheduled before shutdown closed the sockets
            return
        recorder = profiling.active
        started = profiling.now() if recorder is not None else 0
        with self._lock:
            self._flush_now = False
            if self._released:
                self._free_released()
            batch, self._pending, self._pending_rows = self._pending, [], 0
            private, self._private = self._private, {}
        if not batch:
            return
        for seq, sends in private.items():
            for rank, frame in sends:
                self.sockets.publish([wire.topic_for_rank(rank), wire.encode(wire.Private(seq)), frame], copy=False)
        # Raised before the send: a worker may run the batch and report an error for one of its
        # commands before this thread returns from publish, and the loop thread checks the report's
        # seq against this bound (a report under the old bound would be rejected and its read hang).
        self.published_upto = batch[-1].seq + wire.span(batch[-1])
        try:
            frames = wire.encode_batch(batch[0].seq, batch)
        except Exception:   # a field the wire cannot carry (ProtocolError, msgpack's TypeError...)
            frames = wire.encode_batch(batch[0].seq, [self._encodable(c) for c in batch])
        self.sockets.publish(frames)
        self.commands_sent += len(batch)
        self.batches_sent += 1
        if recorder is not None:
            recorder.add("flush", "flush", profiling.LOOP, started, profiling.now(),
                         {"commands": len(batch), "first_seq": batch[0].seq})

    def _encodable(self, command):
        """`command`, or, if msgpack cannot encode one of its fields (a value no op's check
        caught, such as a Python complex fill value), an empty Free in its seq: the workers'
        numbering keeps no gap (a gap ends the session), and the command fails as if it had
        failed on the workers, so the reads of its results and synchronize() raise naming it."""
        try:
            wire.encode_batch(command.seq, [command])
            return command
        except Exception as error:
            if wire.span(command) != 1:
                raise
            kept = self.sites.kept(command.seq)
            op = (kept[2] if type(kept[2]) is str else kept[2].__name__) if kept else type(command).__name__
            self.reads.failures[command.seq] = RemoteFailure(
                command.seq, op, self.sites.site_of(command.seq), type(error).__name__,
                f"dtorch cannot send this command to the workers: {error} (a Python complex number is one such "
                "value: pass torch.tensor(value) instead)", "(on the controller: it never reached a worker)\n",
                self.pool.live_ranks() or [0])
            return wire.Free(command.seq, ())

    async def _probe(self) -> None:
        """Publish probes until every worker has registered: a worker registers only after its
        SUB socket has seen one, so it cannot miss the commands that follow (slow joiners)."""
        while self.pool.starting() and not self.closed:
            with self._publish_lock:
                if self.sockets_open:
                    self.sockets.publish([wire.TOPIC_PROBE, _PROBE])
            await asyncio.sleep(0.02)
