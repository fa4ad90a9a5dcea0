"""Worker-to-worker collectives on GPUs: cupy's NCCL, one communicator per mesh-dim slice (a
tuple of ranks), created lazily on first use and cached. It implements comm.Communicator.

Bootstrap: rank 0 of a group makes an NCCL unique id and publishes it in the controller's
TCPStore under a key named after the group; the others read it there. Members create a group at
the same command (they run the same commands in order), which is what ncclCommInitRank needs.

Streams: a collective is enqueued on the current stream, which the worker has set to the
device's communication stream for the whole redistribute or transfer (CudaDevice.communicate
orders it after compute, records the inputs on it, and hands the compute stream an event to wait
on when the result is read). The host never waits for a collective. The gradient buckets of a
backward are the exception (start_all_reduce): each goes out on a stream of its own, over a
communicator of its ranks that carries only buckets, as soon as its gradients are packed, so it
overlaps the rest of the backward as DDP's reducer does (grad_buckets.py).

agree_max runs over Gloo on the host: it decides whether a redistribute runs at all, and an NCCL
reduction would make the command loop wait for every kernel enqueued before it.

Failures: NCCL has no timeouts of its own. A watchdog thread (as in torch's ProcessGroupNCCL)
aborts every communicator and exits the worker when a collective has not finished within the
timeout, when NCCL reports an asynchronous error, or when the controller marks a peer lost; the
controller then reports this worker lost too, instead of a read returning values that an aborted
collective left half-written.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import os
import sys
import threading
import time

import torch

from .. import protocol as wire
from .comm import (GlooCommunicator, backend_reduce_op, finish_reduction, group_members, group_name, holds_any,
                   reducible)
from .gpu_assignment import cupy_missing_message

__all__ = ["NcclCommunicator", "NCCL_DATATYPES", "NCCL_REDUCE_OPS", "encode_unique_id",
           "decode_unique_id", "import_nccl", "lost_key"]

# ncclDataType_t and ncclRedOp_t from nccl.h (a stable ABI; cupy exports the same numbers as
# NCCL_FLOAT32, NCCL_SUM, ...). Kept as plain numbers so this table is testable without cupy.
# NCCL has no complex type: reductions take a complex tensor's real view (comm.reducible), and
# every other call moves bytes (NCCL_UINT8), which carry any dtype.
NCCL_DATATYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
NCCL_UINT8 = 1
# The primitives only: comm.backend_reduce_op maps every reduce op to one of them.
NCCL_REDUCE_OPS = {"sum": 0, "max": 2, "min": 3}
WATCH_PERIOD_S = 0.5
# Set to 1 to run NCCL even for a one-rank group (normally skipped): lets one GPU exercise the
# whole NCCL path, e.g. scripts/gpu_check.sh.
SINGLE_RANK_VARIABLE = "DTORCH_NCCL_SINGLE_RANK"


lost_key = wire.lost_worker_key


def import_nccl():
    """cupy.cuda.nccl, or an ImportError naming the package to install."""
    try:
        from cupy.cuda import nccl
    except ImportError as error:
        raise ImportError(cupy_missing_message(torch.version.cuda)) from error
    if not getattr(nccl, "available", True):
        raise ImportError("cupy is installed but cannot load the NCCL library (libnccl.so.2): "
                          f"pip install nvidia-nccl-cu{(torch.version.cuda or '12').split('.')[0]}")
    return nccl


def encode_unique_id(unique_id) -> bytes:
    """cupy's unique id as bytes for the store: cupy 14 gives bytes already, older cupy a tuple
    of 128 C chars (signed on x86)."""
    if isinstance(unique_id, (bytes, bytearray)):
        return bytes(unique_id)
    return bytes(value & 0xFF for value in unique_id)


def decode_unique_id(raw: bytes) -> tuple:
    return tuple([value - 256 if value > 127 else value for value in raw])


class NcclCommunicator:
    def __init__(self, store_address: str, rank: int, hostname: str, timeout_s: float = 300.0,
                 device=None):
        self._nccl = import_nccl()
        self.rank, self.device, self.timeout_s = rank, device, timeout_s
        self.host = GlooCommunicator(store_address, rank, hostname, timeout_s)
        self.single_rank = os.environ.get(SINGLE_RANK_VARIABLE) == "1"
        self._comms: dict[tuple, object] = {}   # by ranks, or (ranks, purpose) for the buckets' own
        self._bucket_streams: dict = {}       # device -> the stream start_all_reduce enqueues on
        self._abandoned: list = []
        self.generation = 0   # bumped by regroup after lost ranks are replaced
        self._watchdog = Watchdog(self, store_address)

    def group(self, ranks: tuple, purpose: str = ""):
        """The communicator of `ranks` (created collectively on first use); `purpose` names a
        separate one of the same ranks, whose calls keep their own order (the buckets')."""
        cached = (ranks, purpose) if purpose else ranks
        comm = self._comms.get(cached)
        if comm is None:
            key = "dtorch/nccl/" + group_name(ranks, self.generation) + (f"/{purpose}" if purpose else "")
            index = ranks.index(self.rank)
            if index == 0:
                self.host.store.set(key, encode_unique_id(self._nccl.get_unique_id()))
            raw = self.host.store.get(key)
            with self._watchdog.blocking(f"creating the NCCL communicator of ranks {ranks}"):
                comm = self._create(len(ranks), raw, index)
            self._comms[cached] = comm
        return comm

    def regroup(self, generation: int, replaced: tuple) -> None:
        """See Communicator.regroup (the worker regroups the host communicator itself)."""
        self.generation = generation
        for key in [k for k in self._comms if holds_any(group_members(k), replaced)]:
            self._abandoned.append(self._comms.pop(key))

    def _create(self, size: int, raw: bytes, index: int):
        """cupy 14 takes the id as bytes; older cupy as a tuple. The type check fails before any
        NCCL call, so trying one form and then the other is safe."""
        try:
            return self._nccl.NcclCommunicator(size, raw, index)
        except TypeError:
            return self._nccl.NcclCommunicator(size, decode_unique_id(raw), index)

    def _skips(self, ranks: tuple, *tensors: torch.Tensor) -> bool:
        """Nothing to call NCCL for: one rank (unless forced), or no elements, which every member
        sees alike since kernels pad pieces to equal sizes (an empty tensor may have no pointer)."""
        return (len(ranks) == 1 and not self.single_rank) or any(t.numel() == 0 for t in tensors)

    # --- collectives over one group; every member calls the same one -------------------------
    def all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """In place when `tensor` is contiguous (as kernels pass it); use the returned tensor."""
        tensor = tensor.contiguous()
        if self._skips(ranks, tensor):
            return tensor
        carried = reducible(tensor, reduce_op)   # a complex tensor as its real view, in its memory
        kind, op = _reduction(carried, reduce_op)
        with self._enqueue(ranks) as (comm, stream):
            comm.allReduce(carried.data_ptr(), carried.data_ptr(), carried.numel(), kind, op, stream)
        return finish_reduction(tensor, reduce_op, ranks)

    background_collectives = True   # the buckets' communicator and stream: see start_all_reduce

    def prepare_background(self, ranks: tuple) -> None:
        self.group(ranks, BUCKETS)

    def start_all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str):
        """A gradient bucket's all-reduce, begun now beside the caller's work, as DDP's reducer:
        on the device's bucket stream, after what the current stream has queued (the packing of
        `tensor`), over the communicator of `ranks` that carries only buckets. The backward's other
        collectives of these ranks run on the usual communicator, so neither order can cross the
        other on different members, which one communicator on one stream would risk. Finishing
        makes the current stream wait for it; the host waits for nothing."""
        tensor = tensor.contiguous()
        if self._skips(ranks, tensor):
            return lambda: tensor
        carried = reducible(tensor, reduce_op)
        kind, op = _reduction(carried, reduce_op)
        caller, stream = torch.cuda.current_stream(tensor.device), self._bucket_stream(tensor.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream), self._enqueue(ranks, BUCKETS) as (comm, handle):
            comm.allReduce(carried.data_ptr(), carried.data_ptr(), carried.numel(), kind, op, handle)
        carried.record_stream(stream)   # the allocator must not hand its memory out before NCCL is done
        reduced = torch.cuda.Event()
        reduced.record(stream)

        def finish() -> torch.Tensor:
            torch.cuda.current_stream(tensor.device).wait_event(reduced)
            return finish_reduction(tensor, reduce_op, ranks)
        return finish

    def _bucket_stream(self, device: torch.device):
        stream = self._bucket_streams.get(device)
        if stream is None:
            stream = self._bucket_streams[device] = torch.cuda.Stream(device=device)
        return stream

    def all_gather(self, ranks: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's `tensor` (same shape everywhere), stacked on a new dim 0 in one buffer."""
        tensor = tensor.contiguous()
        gathered = tensor.new_empty((len(ranks),) + tuple(tensor.shape))
        if self._skips(ranks, tensor):
            return gathered.copy_(tensor.expand_as(gathered))
        with self._enqueue(ranks) as (comm, stream):
            comm.allGather(tensor.data_ptr(), gathered.data_ptr(), _nbytes(tensor), NCCL_UINT8, stream)
        return gathered

    def start_all_gather(self, ranks: tuple, tensor: torch.Tensor):
        """Enqueued at once on the current stream (the worker's communication stream), like
        every NCCL call: the compute stream waits for it through the command's event."""
        return self.all_gather(ranks, tensor), lambda: None

    def reduce_scatter(self, ranks: tuple, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """`stacked` holds one equal-size piece per member on dim 0; returns this member's piece
        reduced over all members."""
        stacked = stacked.contiguous()
        if self._skips(ranks, stacked):
            return stacked[0].clone()
        output = torch.empty_like(stacked[0])
        carried = reducible(output, reduce_op)   # complex: the real views of both, in their memory
        kind, op = _reduction(carried, reduce_op)
        with self._enqueue(ranks) as (comm, stream):
            comm.reduceScatter(stacked.data_ptr(), carried.data_ptr(), carried.numel(), kind, op, stream)
        return finish_reduction(output, reduce_op, ranks)

    def all_to_all(self, ranks: tuple, send: torch.Tensor) -> torch.Tensor:
        """`send` stacks one equal-size piece per member on dim 0; returns the pieces received.
        cupy has no ncclAllToAll: one grouped send/recv pair per member does the same."""
        send = send.contiguous()
        if self._skips(ranks, send):
            return send.clone()
        receive = torch.empty_like(send)
        peers = range(len(ranks))
        self._point_to_point(ranks, [(p, send[p]) for p in peers], [(p, receive[p]) for p in peers])
        return receive

    def exchange(self, ranks: tuple, sends: list, receives: list) -> None:
        """Point-to-point within `ranks` (a transfer between two CUDA meshes): sends/receives are
        (peer rank, contiguous tensor) pairs, posted as one NCCL group so no order can deadlock.
        Every member joins, even with nothing to move: creating the communicator is collective."""
        if len(ranks) == 1:
            return
        index = ranks.index
        self._point_to_point(ranks, [(index(peer), t) for peer, t in sends],
                             [(index(peer), t) for peer, t in receives])

    def _point_to_point(self, ranks: tuple, sends: list, receives: list) -> None:
        """(index in `ranks`, tensor) pairs, all in one ncclGroupStart/End."""
        with self._enqueue(ranks) as (comm, stream):
            self._nccl.groupStart()
            try:
                for peer, tensor in sends:
                    if tensor.numel():   # the receiver skips the same empty block
                        comm.send(tensor.data_ptr(), _nbytes(tensor), NCCL_UINT8, peer, stream)
                for peer, tensor in receives:
                    if tensor.numel():
                        comm.recv(tensor.data_ptr(), _nbytes(tensor), NCCL_UINT8, peer, stream)
            finally:
                self._nccl.groupEnd()

    def agree_max(self, ranks: tuple, value: int) -> int:
        """The largest `value` any member passed, over Gloo on the host (see the module doc)."""
        return self.host.agree_max(ranks, value)

    def close(self) -> None:
        """Abort, not destroy: destroy waits for pending collectives, which may never finish."""
        self._watchdog.stop()
        self.abort()
        self.host.close()

    def abort(self) -> None:
        comms, self._comms = list(self._comms.values()), {}
        for comm in comms:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 -- tearing down; the next one must still go
                pass

    @contextlib.contextmanager
    def _enqueue(self, ranks: tuple, purpose: str = ""):
        """(communicator, current stream handle) for one NCCL call; afterwards an event on that
        stream lets the watchdog see whether the call finishes in time."""
        stream = torch.cuda.current_stream()
        yield self.group(ranks, purpose), stream.cuda_stream
        done = torch.cuda.Event()
        done.record(stream)
        self._watchdog.track(done, ranks)


BUCKETS = "buckets"   # the purpose of the communicators start_all_reduce uses


def _reduction(tensor: torch.Tensor, reduce_op: str) -> tuple[int, int]:
    kind = NCCL_DATATYPES.get(tensor.dtype)
    if kind is None:
        legal = ", ".join(str(d).replace("torch.", "") for d in NCCL_DATATYPES)
        raise TypeError(f"NCCL cannot reduce {tensor.dtype} tensors (P({reduce_op}) -> R or S): "
                        f"reducible dtypes are {legal}; convert with .to(...) first")
    return kind, backend_reduce_op(reduce_op, NCCL_REDUCE_OPS)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Watchdog:
    """A daemon thread that turns a stuck or failed NCCL communicator into a worker exit."""

    def __init__(self, communicator: NcclCommunicator, store_address: str):
        self.communicator, self.store_address = communicator, store_address
        self.pending: collections.deque = collections.deque()    # (event, enqueued at, ranks)
        self._blocked: tuple[str, float] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nccl-watchdog", daemon=True)
        self._thread.start()

    def track(self, event, ranks: tuple) -> None:
        self.pending.append((event, time.monotonic(), ranks))

    @contextlib.contextmanager
    def blocking(self, what: str):
        """Mark a host call that returns only when every peer joins (communicator creation)."""
        self._blocked = (what, time.monotonic())
        try:
            yield
        finally:
            self._blocked = None

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(2 * WATCH_PERIOD_S)

    def _run(self) -> None:
        store = self._connect()
        while not self._stopped.wait(WATCH_PERIOD_S):
            problem = self._overdue() or self._async_error() or self._lost_peer(store)
            if problem and not self._stopped.is_set():
                self._fail(problem)

    def _connect(self):
        """A store client of its own (the main thread's is not shared across threads); None if
        the store cannot be reached, and then only timeouts and NCCL errors are watched."""
        import torch.distributed as dist
        host, port = self.store_address.rsplit(":", 1)
        try:
            return dist.TCPStore(host, int(port), is_master=False,
                                 timeout=datetime.timedelta(seconds=self.communicator.timeout_s))
        except Exception:  # noqa: BLE001
            return None

    def _overdue(self) -> str | None:
        now, limit = time.monotonic(), self.communicator.timeout_s
        while self.pending and self.pending[0][0].query():
            self.pending.popleft()
        if self.pending and now - self.pending[0][1] > limit:
            return f"a collective over ranks {self.pending[0][2]} did not finish within {limit:.0f}s"
        blocked = self._blocked
        if blocked is not None and now - blocked[1] > limit:
            return f"{blocked[0]} took longer than {limit:.0f}s (a peer never joined)"
        return None

    def _async_error(self) -> str | None:
        for ranks, comm in list(self.communicator._comms.items()):
            try:
                comm.check_async_error()
            except Exception as error:  # noqa: BLE001 -- any NCCL error ends the communicator
                return f"NCCL reported an error on ranks {ranks}: {error}"
        return None

    def _lost_peer(self, store) -> str | None:
        if store is None:
            return None
        peers = {r for ranks in list(self.communicator._comms) for r in ranks} - {self.communicator.rank}
        try:
            lost = [peer for peer in sorted(peers) if store.check([lost_key(peer)])]
        except Exception:  # noqa: BLE001 -- the controller is going away; its own exit stops us
            self._stopped.set()
            return None
        return f"peer rank {lost[0]} is lost" if lost else None

    def _fail(self, problem: str) -> None:
        print(f"dtorch worker {self.communicator.rank}: {problem}; aborting NCCL communicators and "
              "exiting, since results computed since cannot be trusted", file=sys.stderr, flush=True)
        self.communicator.abort()
        os._exit(4)
