"""The controller's side of reads: futures the user awaits, the replies that complete them, and
the records of remote failures that turn into exceptions at the user's next read. ReadBook
holds both for one session: the reads the workers still owe, and every failure they reported.
"""
from __future__ import annotations

import asyncio
import collections
import collections.abc
import concurrent.futures
import ctypes
import math
import time
from dataclasses import dataclass, field

import torch

from ...spec.placements import local_region, narrow_to_box
from ...errors import DependencyError, DTorchError, RemoteError
from ...ops.tensor_meta import TensorMeta
from . import interrupts
from .. import protocol as wire

__all__ = ["Future", "FetchRead", "SyncRead", "RemoteFailure", "ReadBook"]


class Future(collections.abc.Coroutine):
    """The result of a read. `await f` from any event loop (it never blocks that loop),
    `asyncio.run(f)`, `f.result(timeout)` from sync code, `f.done()` to ask without waiting.

    It is a Coroutine so that asyncio.run() and create_task() take it directly; each `await`
    gets a fresh waiter, so it can be awaited any number of times."""

    def __init__(self, inner: concurrent.futures.Future | None = None, receiver=None):
        """receiver: the controller. A thread that blocks in result() takes the reply off the
        socket itself (receiver.receive_here); a future awaited or polled instead asks the
        controller's loop thread to watch the socket (receiver.wake_receiver)."""
        self._inner = inner or concurrent.futures.Future()
        self._driven = None
        self._receiver = receiver

    def __await__(self):
        if self._receiver is not None and not self._inner.done():
            self._receiver.wake_receiver()
        return _waiter(self._inner).__await__()

    # Coroutine protocol, used when a Task drives this object directly (asyncio.run(f)).
    def send(self, value):
        if self._driven is None:
            self._driven = self.__await__()
        return self._driven.send(value)

    def throw(self, *error):
        if self._driven is None:
            self._driven = self.__await__()
        return self._driven.throw(*error)

    def close(self) -> None:
        if self._driven is not None:
            self._driven.close()

    def result(self, timeout: float | None = None):
        self._wait(timeout)
        return self._inner.result(0)

    def done(self) -> bool:
        if self._inner.done():
            return True
        if self._receiver is not None:
            self._receiver.wake_receiver()
        return False

    def exception(self, timeout: float | None = None):
        self._wait(timeout)
        return self._inner.exception(0)

    def _wait(self, timeout: float | None) -> None:
        """Block until done or `timeout` passes (then result() raises TimeoutError). With a
        controller: it takes the reply off the socket on this thread if it can, and the wait
        stays interruptible and supervised (ReplyReceiver.wait_for)."""
        if self._inner.done():
            return
        if self._receiver is not None:
            self._receiver.wait_for(self._inner, timeout)
        else:
            wait_interruptibly(self._inner, timeout)

    # DTorch's TensorFuture spellings (x.to_torch_async().get()); unlike DTorch's, a result can
    # be read any number of times, so is_ready() stays True after get().
    def get(self):
        return self.result()

    def is_ready(self) -> bool:
        return self.done()

    def __repr__(self) -> str:
        return f"<dtorch.Future {'done' if self.done() else 'pending'}>"


def wait_interruptibly(inner: concurrent.futures.Future, timeout: float | None) -> None:
    """Wait in slices, so that a Ctrl-C deferred meanwhile (interrupts.py) is raised here."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not inner.done():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        wait_done(inner, 0.05 if left is None else min(left, 0.05))
        interrupts.raise_pending()


def wait_done(inner: concurrent.futures.Future, seconds: float) -> None:
    """Block until `inner` is done or `seconds` pass, whatever its outcome."""
    try:
        inner.exception(seconds)
    except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
        pass


def _waiter(inner: concurrent.futures.Future) -> asyncio.Future:
    """An asyncio future of the running loop that takes `inner`'s outcome. Not asyncio.wrap_future:
    it cancels the inner future when its waiter is cancelled (asyncio.wait_for timing out, a task
    cancelled), and then every other waiter, f.result(), and the reply itself met a cancelled
    read whose value had arrived. Cancelling an await here cancels only that await."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle(done: concurrent.futures.Future) -> None:   # on whichever thread resolves `inner`
        try:
            loop.call_soon_threadsafe(_copy_outcome, done, waiter)
        except RuntimeError:   # the loop has closed (asyncio.run returned after a timeout): no one waits
            pass
    inner.add_done_callback(settle)
    return waiter


def _copy_outcome(source: concurrent.futures.Future, waiter: asyncio.Future) -> None:
    if waiter.done():   # this await was cancelled
        return
    if source.cancelled():
        waiter.cancel()
        return
    error = source.exception()
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(source.result())


@dataclass
class RemoteFailure:
    """One command that raised on one or more ranks."""
    seq: int
    op: str
    site: str
    exception_type: str
    message: str
    traceback: str
    ranks: list = field(default_factory=list)
    reported: bool = False

    def error(self, produced_seq: int) -> RemoteError:
        error_type = RemoteError if produced_seq == self.seq else DependencyError
        self.reported = True
        return error_type(self.op, self.seq, self.ranks, self.traceback, self.site,
                          self.exception_type, self.message)


class ReadBook:
    """The reads the workers still owe (by the seq of their command) and the failures they
    reported (by the seq of the command that raised). The controller adds reads as it submits
    them; whoever holds the ROUTER lock settles them (worker_messages.py); a lost worker fails
    the reads that wait on it (lost_workers.py)."""

    def __init__(self) -> None:
        self.pending: dict[int, _Read] = {}
        self.failures: dict[int, RemoteFailure] = {}
        # seq -> ranks that still answer a read a loss failed: their replies are expected
        self._abandoned: dict[int, set] = {}
        # failure seq -> reads whose replies named it as their origin before its record arrived
        self._waiting_for_failure: dict[int, list] = collections.defaultdict(list)
        self.idle_upto = -1   # the last read every live worker has answered (READ_SPIN_S)

    def owed_to_abandoned(self, seq: int, rank: int) -> bool:
        """A survivor's reply to a read that failed when another of its ranks was lost: expected."""
        owed = self._abandoned.get(seq)
        if owed is None or rank not in owed:
            return False
        owed.discard(rank)
        if not owed:
            del self._abandoned[seq]
        return True

    def finish(self, seq: int, read: _Read, live_ranks) -> None:
        """Every rank has answered `read`: settle it, unless it waits for a failure's record."""
        if read.finish(self.failures) is False:   # False only where a rank answered "poisoned"
            origin = read.poisoned_origin()
            assert origin is not None
            self._waiting_for_failure[origin].append(seq)
            return
        self.pending.pop(seq, None)
        if seq > self.idle_upto and all(rank in read.statuses for rank in live_ranks):
            self.idle_upto = seq   # every live worker has run every command before it

    def failure_recorded(self, seq: int, live_ranks) -> None:
        """The record of command `seq`'s failure is in `failures`: the reads that waited for it
        settle now."""
        for waiting in self._waiting_for_failure.pop(seq, []):
            read = self.pending.get(waiting)
            if read is not None:
                self.finish(waiting, read, live_ranks)

    def fail_reads_of(self, rank: int, error: Exception) -> None:
        """Worker `rank` is lost: every read waiting on it fails with `error`."""
        for owed in self._abandoned.values():   # it will not answer reads abandoned before either
            owed.discard(rank)
        for seq, read in list(self.pending.items()):
            if rank in read.waiting:
                read.fail(error)
                self.pending.pop(seq, None)
                self._abandoned[seq] = read.waiting - {rank}
        for seq in [seq for seq, owed in self._abandoned.items() if not owed]:
            del self._abandoned[seq]

    def fail_all(self, error: Exception) -> None:
        for read in list(self.pending.values()):
            read.fail(error)
        self.pending.clear()

    def unread_failures(self) -> list:
        """Failures no read or synchronize() has raised, oldest first."""
        return sorted((f for f in self.failures.values() if not f.reported), key=lambda f: f.seq)


class _Read:
    """Replies expected from a set of ranks for one command seq."""

    def __init__(self, ranks, future: Future):
        self.waiting = set(ranks)
        self.statuses: dict[int, tuple] = {}
        self.frames: dict[int, list] = {}
        self.future = future

    def check(self, rank: int, status: str, frames: list) -> str | None:
        """Why this reply cannot belong to this read, or None. Replies without bytes only."""
        if status not in wire.REPLY_STATUSES:
            return f"status {status[:40]!r}"
        return f"{len(frames)} unexpected data frame(s)" if frames else None

    def add(self, rank: int, status: str, origin: int, frames: list) -> bool:
        """Record one rank's reply; True when every expected rank has answered."""
        self.waiting.discard(rank)
        self.statuses[rank] = (status, origin)
        if frames:
            self.frames[rank] = frames
        return not self.waiting

    def fail(self, error: Exception) -> None:
        # The loop thread and a reading thread that supervises its own read (reply_receiving.py)
        # may settle the same read at once: the second one loses, quietly.
        if not self.future._inner.done():
            try:
                self.future._inner.set_exception(error)
            except concurrent.futures.InvalidStateError:
                pass

    def succeed(self, value) -> None:
        if not self.future._inner.done():
            try:
                self.future._inner.set_result(value)
            except concurrent.futures.InvalidStateError:
                pass

    def finish(self, failures: dict) -> bool | None:
        """Every rank has answered: settle the future. False: it must wait for the record of a
        failure a reply named (ReadBook.failure_recorded)."""
        raise NotImplementedError

    def poisoned_origin(self) -> int | None:
        origins = [origin for status, origin in self.statuses.values() if status == "poisoned"]
        return min(origins) if origins else None


class SyncRead(_Read):
    def finish(self, failures) -> None:
        self.succeed(None)


# A read of at most this many bytes from one rank has its result made while the reply is on its way.
PREPARED_READ_BYTES = 1 << 16


class FetchRead(_Read):
    def __init__(self, ranks, future: Future, meta: TensorMeta, senders, produced_seq: int):
        super().__init__(ranks, future)
        self.meta, self.senders, self.produced_seq = meta, senders, produced_seq
        self.prepared: torch.Tensor | None = None

    def prepare(self) -> None:
        """Once the Fetch is published, while the workers answer: make the result now, so that the
        reply only copies its bytes in. A thread that wakes for a reply runs its first torch calls
        on cold caches: on a 2-core VM, frombuffer + reshape took 2-6 us back to back and 32-45 us
        after a 10 ms sleep (benchmarks/read_idle.py), and here that cost overlaps the round trip."""
        meta = self.meta
        if len(self.senders) == 1 and math.prod(meta.shape) * meta.dtype.itemsize <= PREPARED_READ_BYTES:
            self.prepared = torch.empty(meta.shape, dtype=meta.dtype)

    def check(self, rank: int, status: str, frames: list) -> str | None:
        """A sender's "ok" carries exactly its shard's bytes; every other reply carries none."""
        if status != "ok" or rank not in self.senders:
            return super().check(rank, status, frames)
        expected = math.prod(self.meta.local_shape(rank)) * self.meta.dtype.itemsize
        got = sum(len(f) for f in frames)   # zero frames for an empty shard is fine
        if got != expected or len(frames) > 1:
            return f"{got} bytes in {len(frames)} frame(s) where its shard has {expected}"
        return None

    def finish(self, failures: dict) -> bool:
        """Resolve the future; False if it must wait for a failure record still in flight."""
        origin = self.poisoned_origin()
        if origin is not None:
            failure = failures.get(origin)
            if failure is None:
                return False
            self.fail(failure.error(self.produced_seq))
            return True
        failure = failures.get(self.produced_seq)   # every rank computed it, and then it failed
        if failure is not None:                     # anyway (a warning the filters made an error)
            self.fail(failure.error(self.produced_seq))
            return True
        missing = [r for r, (status, _) in self.statuses.items() if status == "missing"]
        if missing:
            self.fail(DTorchError(f"tensor {self.meta.describe()} is not on rank(s) {missing}: "
                                  "it was freed or never created there"))
            return True
        self.succeed(self._assemble())
        return True

    def _assemble(self) -> torch.Tensor:
        meta = self.meta
        if len(self.senders) == 1:   # the reply's bytes, copied once into memory the tensor owns
            (rank,) = self.senders
            frames = self.frames.get(rank)
            prepared = self.prepared   # (None if the reply came before prepare ran, on another thread)
            if not frames or not len(frames[0].buffer):
                return torch.empty(meta.shape, dtype=meta.dtype) if prepared is None else prepared
            if prepared is not None:   # check() has matched the frame's length to the shard's
                ctypes.memmove(prepared.data_ptr(), frames[0].bytes, len(frames[0].buffer))
                return prepared
            return torch.frombuffer(bytearray(frames[0].buffer), dtype=meta.dtype).reshape(meta.shape)
        out = torch.empty(meta.shape, dtype=meta.dtype)
        for rank in self.senders:
            box = local_region(meta.shape, meta.mesh, meta.placements, meta.mesh.coordinate_of(rank))
            narrow_to_box(out, *box).copy_(_piece(self.frames.get(rank), meta, rank))
        return out


def _piece(frames, meta: TensorMeta, rank: int) -> torch.Tensor:
    shape = meta.local_shape(rank)
    buffer = frames[0].buffer if frames else b""
    return wire.tensor_from_frame(buffer, meta.dtype, shape)
