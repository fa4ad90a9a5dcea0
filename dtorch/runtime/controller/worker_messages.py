"""The controller's side of every message a worker sends (wire.FROM_WORKER): one handler each,
named after it (`_on_register`, `_on_reply`, ...), run by whichever thread holds the ROUTER
lock (the loop thread, or a thread blocked on a read: reply_receiving.ReplyReceiver).

Every handler first checks who sent the message (docs/reference/protocol.md, "Acceptance"); a message
that fails a check raises ProtocolError, and the caller drops it, counts it (`reject`) and logs why.

WorkerMessages is owned by the Controller. It settles the session's reads (reads.ReadBook),
records the failures workers report, keeps the worker records current (cluster.WorkerPool), and
calls `lose` for a worker whose command stream broke. What it reads of the controller itself is
`_Stream`.
"""
from __future__ import annotations

import builtins
import time
import warnings
from typing import Protocol
from collections.abc import Callable

from ...errors import ProtocolError
from .. import protocol as wire
from ..transport import ControllerSockets
from .admission import Rejections, secret_matches
from .cluster import WorkerPool, WorkerRecord
from .command_sites import SITE_RING, CommandSites
from .reads import ReadBook, RemoteFailure

__all__ = ["WorkerMessages"]

_PONG = wire.encode(wire.Pong())


class _Stream(Protocol):
    """What the handlers read of the controller: how far the command stream is published (a
    worker is never sent an error's seq above it), and what a registering worker is told."""
    published_upto: int
    secret: str
    store_address: str
    gloo_timeout_s: float


class WorkerMessages:
    def __init__(self, stream: _Stream, sockets: ControllerSockets, pool: WorkerPool, reads: ReadBook,
                 sites: CommandSites, rejections: Rejections, lose: Callable[[WorkerRecord, str], None]):
        self._stream, self._sockets, self._pool, self._reads = stream, sockets, pool, reads
        self._sites, self._rejections, self._lose = sites, rejections, lose
        self._workers = pool.workers
        self._handlers = {kind: getattr(self, wire.handler_name(kind, "_on_")) for kind in wire.FROM_WORKER}
        self._warning_registries: dict[str, dict] = {}   # file -> warnings' registry (shown once per line)
        self._warnings_shown: set = set()   # (seq, category, message): one copy per command, of all ranks'

    def on_message(self, identity: bytes, header: bytes | None, data: list) -> None:
        """Only well-formed messages reach a handler (types and frame counts checked first);
        each handler then checks who sent it (docs/reference/protocol.md, "Acceptance")."""
        message = wire.decode_from_worker(header, data)
        self._handlers[type(message)](identity, message, data)

    def reject(self, identity: bytes, reason: str) -> None:
        """Drop, count, log with a rate limit. A peer that never registered also hears the reason
        (once per log interval): a worker of another dtorch version learns why it was refused."""
        logged = self._rejections.record(identity, reason)
        if logged and identity.startswith(b"w") and not self._is_registered(identity):
            self._sockets.send_to(identity, [wire.encode(wire.Refused(reason))])

    def _is_registered(self, identity: bytes) -> bool:
        return any(w.identity == identity for w in self._workers.values())

    def _sender(self, identity: bytes, rank: int) -> WorkerRecord:
        """The worker `rank` if `identity` is the DEALER that registered as it."""
        worker = self._workers.get(rank)
        if worker is None or worker.identity is None or worker.identity != identity:
            raise ProtocolError(f"a message for rank {rank} from a peer that did not register as it")
        return worker

    # --- one handler per message a worker sends (wire.FROM_WORKER), named after it -------------
    def _on_register(self, identity: bytes, message: wire.Register, data: list) -> None:
        rank, host, pid, device, secret, threads = message
        if not secret_matches(secret, self._stream.secret):
            raise ProtocolError("a registration without the run's secret")
        worker = self._workers.get(rank)
        if worker is None or worker.identity is not None or not identity.startswith(b"w%d:" % rank):
            raise ProtocolError(f"a registration for rank {rank}, which is unknown or registered already")
        worker.identity, worker.heartbeat_identity = identity, b"h" + identity[1:]
        if worker.host == "localhost":
            worker.host = host
        worker.pid, worker.device, worker.threads = pid, device, threads
        worker.last_heartbeat = time.monotonic()
        stream = self._stream
        worker.start_seq = stream.published_upto
        welcome = wire.Welcome(stream.published_upto, stream.store_address, float(stream.gloo_timeout_s))
        self._sockets.send_to(identity, [wire.encode(welcome)])
        self._pool.mark_registered(worker)

    def _on_heartbeat(self, identity: bytes, message: wire.Heartbeat, data: list) -> None:
        rank = message.rank
        worker = self._workers.get(rank)
        if worker is None or worker.heartbeat_identity is None or worker.heartbeat_identity != identity:
            raise ProtocolError(f"a heartbeat for rank {rank} from a peer that did not register as it")
        worker.last_heartbeat = time.monotonic()
        worker.live_tensors, worker.rss_bytes = message.live_tensors, message.rss_bytes
        worker.busy_seq, worker.busy_s = message.busy_seq, message.busy_s
        self._sockets.send_to(identity, [_PONG])

    def _on_reply(self, identity: bytes, message: wire.Reply, frames: list) -> None:
        seq, rank, status, origin = message
        self._sender(identity, rank)
        read = self._reads.pending.get(seq)
        if read is None or rank not in read.waiting:
            if self._reads.owed_to_abandoned(seq, rank):
                return
            raise ProtocolError(f"a reply from rank {rank} for command #{seq}, which it does not owe")
        problem = read.check(rank, status, frames)
        if problem is not None:   # from the registered worker itself: the read cannot be trusted
            self._reads.pending.pop(seq, None)
            read.fail(ProtocolError(f"rank {rank} answered command #{seq} with {problem}{self._made_by(read)}"))
            raise ProtocolError(problem)
        if read.add(rank, status, origin, frames):
            self._reads.finish(seq, read, self._pool.live_ranks())

    def _made_by(self, read) -> str:
        """Which command made the tensor a read's bytes do not fit, and the likely cause: torch's
        meta kernel (dtorch's inference) and its real one disagree on that op's result."""
        made = getattr(read, "produced_seq", -1)
        if made < 0:
            return ""
        return (f": the tensor ({read.meta.describe()}) was made by {self._sites.describe(made)}, and the worker's "
                "result has another dtype or shape than dtorch inferred from torch's meta kernel for it")

    def _on_error_report(self, identity: bytes, report: wire.ErrorReport, data: list) -> None:
        seq, rank, op, exception_type, message, traceback_text = report
        worker = self._sender(identity, rank)
        if not worker.start_seq <= seq <= self._stream.published_upto:
            raise ProtocolError(f"an error from rank {rank} for command #{seq}, which it was never sent")
        if op == wire.PROTOCOL_FAILURE:
            self._lose(worker, f"protocol error: {message}")
            return
        failure = self._reads.failures.get(seq)
        if failure is not None and rank in failure.ranks:
            raise ProtocolError(f"a second error from rank {rank} for command #{seq}")
        if failure is None:
            site = self._sites.site_of(seq)
            if "(replayed" in site and "(freed, or never created)" in message:
                message += _FREED_IN_REPLAY
            failure = self._reads.failures[seq] = RemoteFailure(seq, op, site, exception_type, message,
                                                                traceback_text)
        failure.ranks.append(rank)
        self._reads.failure_recorded(seq, self._pool.live_ranks())

    def _on_warning_report(self, identity: bytes, report: wire.WarningReport, data: list) -> None:
        """A Python warning a command raised on a worker, shown here as a warning at the user's
        line that issued the command (a compiled call's line for a replay). Every rank that runs
        the op sends it; Python's registry shows it once per text, category and line, as it does
        any warning. It is shown before any later read returns: a worker sends its warnings
        before its replies, on the same socket. Where the filters make it an error, it is the
        command's failure: a read of the command's result raises it, as synchronize() does."""
        seq, rank, category, message = report
        worker = self._sender(identity, rank)
        if not worker.start_seq <= seq <= self._stream.published_upto:
            raise ProtocolError(f"a warning from rank {rank} for command #{seq}, which it was never sent")
        if (seq, category, message) in self._warnings_shown:   # another rank's copy of the same one
            return
        if len(self._warnings_shown) >= SITE_RING:
            self._warnings_shown.clear()
        self._warnings_shown.add((seq, category, message))
        what, filename, line = self._sites.warning_site(seq)
        found = getattr(builtins, category, None)   # a class of torch's own shows as UserWarning
        category_type = found if isinstance(found, type) and issubclass(found, Warning) else UserWarning
        try:
            warnings.warn_explicit(f"{what} (on the workers): {message}", category_type, filename, line,
                                   registry=self._warning_registries.setdefault(filename, {}))
        except Warning as raised:   # the user's filters make it an error (-W error): the op failed
            self._failed_by_warning(seq, rank, what, raised)

    def _failed_by_warning(self, seq: int, rank: int, what: str, raised: Warning) -> None:
        """Command `seq` failed as torch's op would under these filters: its result's read raises."""
        failures = self._reads.failures
        if seq not in failures:
            failures[seq] = RemoteFailure(seq, what, self._sites.site_of(seq), type(raised).__name__, str(raised),
                                          "(a worker's warning, made an error by the warnings filters)", [rank])


# A replay reads the tensors its function read from outside its arguments by the ids they had at
# the capture (docs/design/compile.md, "What is not replayed"): one freed since is missing on the workers.
_FREED_IN_REPLAY = ("; in a dtorch.compile replay this is most often a tensor the compiled function reads from "
                    "outside its arguments (a closure, a global, a module attribute) that was rebound and "
                    "freed after the first call: the replay reads the tensor the capture saw. Pass such a "
                    "tensor as an argument")
