"""Worker-to-worker collectives on GPUs: cupy's NCCL, one communicator per mesh-dim slice (a
tuple of ranks), created lazily on first use and cached. The same methods as GlooCommunicator.

Bootstrap: rank 0 of a group makes an NCCL unique id and publishes it in the controller's
TCPStore under a key named after the group; the others read it there. Members create a group at
the same command (they run the same commands in order), which is what ncclCommInitRank needs.

Streams: a collective runs on the device's communication stream after an event recorded on the
compute stream, and the compute stream waits for the collective's own event before it goes on;
the host never waits. Tensors touched on the communication stream are recorded on it, so the
caching allocator cannot hand their memory out again before the collective is done with it.

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

from . import protocol as wire

__all__ = ["NcclCommunicator", "NCCL_DATATYPES", "NCCL_REDUCE_OPS", "encode_unique_id",
           "decode_unique_id", "import_nccl", "lost_key"]

# ncclDataType_t and ncclRedOp_t from nccl.h (a stable ABI; cupy exports the same numbers as
# NCCL_FLOAT32, NCCL_SUM, ...). Kept as plain numbers so this table is testable without cupy.
NCCL_DATATYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
NCCL_UINT8 = 1
# avg is sum, then a division on the compute stream (as GlooCommunicator does).
NCCL_REDUCE_OPS = {"sum": 0, "avg": 0, "max": 2, "min": 3}
WATCH_PERIOD_S = 0.5
# Set to 1 to run NCCL even for a one-rank group (normally skipped): lets one GPU exercise the
# whole NCCL path, e.g. scripts/gpu_check.sh.
SINGLE_RANK_VARIABLE = "DTORCH_NCCL_SINGLE_RANK"


lost_key = wire.lost_worker_key


def import_nccl():
    """cupy.cuda.nccl, or an ImportError naming the package to install."""
    from .cuda import cupy_missing_message
    try:
        from cupy.cuda import nccl
    except ImportError as error:
        raise ImportError(cupy_missing_message(torch.version.cuda)) from error
    if not getattr(nccl, "available", True):
        raise ImportError("cupy is installed but cannot load the NCCL library (libnccl.so.2): "
                          f"pip install nvidia-nccl-cu{(torch.version.cuda or '12').split('.')[0]}")
    return nccl


def encode_unique_id(unique_id) -> bytes:
    """cupy's unique id (128 C chars, signed on x86) as bytes for the store."""
    return bytes(value & 0xFF for value in unique_id)


def decode_unique_id(raw: bytes) -> tuple:
    return tuple(value - 256 if value > 127 else value for value in raw)


class NcclCommunicator:
    def __init__(self, store_address: str, rank: int, hostname: str, timeout_s: float = 300.0,
                 device=None):
        from .comm import GlooCommunicator
        self._nccl = import_nccl()
        self.rank, self.device, self.timeout_s = rank, device, timeout_s
        self.host = GlooCommunicator(store_address, rank, hostname, timeout_s)
        self.stream = device.comm_stream
        self.single_rank = os.environ.get(SINGLE_RANK_VARIABLE) == "1"
        self._comms: dict[tuple, object] = {}
        self._watchdog = Watchdog(self, store_address)

    def group(self, ranks: tuple):
        comm = self._comms.get(ranks)
        if comm is None:
            key = "dtorch/nccl/" + "-".join(map(str, ranks))
            index = ranks.index(self.rank)
            if index == 0:
                self.host.store.set(key, encode_unique_id(self._nccl.get_unique_id()))
            unique_id = decode_unique_id(self.host.store.get(key))
            with self._watchdog.blocking(f"creating the NCCL communicator of ranks {ranks}"):
                comm = self._nccl.NcclCommunicator(len(ranks), unique_id, index)
            self._comms[ranks] = comm
        return comm

    def _skips(self, ranks: tuple) -> bool:
        return len(ranks) == 1 and not self.single_rank

    # --- collectives over one group; every member calls the same one -------------------------
    def all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """In place when `tensor` is contiguous (as kernels pass it); use the returned tensor."""
        tensor = tensor.contiguous()
        if self._skips(ranks):
            return tensor
        kind, op = _reduction(tensor, reduce_op)
        with self._on_comm_stream(ranks, tensor) as (comm, stream):
            comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), kind, op, stream)
        if reduce_op == "avg":
            tensor /= len(ranks)
        return tensor

    def all_gather(self, ranks: tuple, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        if self._skips(ranks):
            return [tensor.clone()]
        gathered = tensor.new_empty((len(ranks),) + tuple(tensor.shape))
        with self._on_comm_stream(ranks, tensor, gathered) as (comm, stream):
            comm.allGather(tensor.data_ptr(), gathered.data_ptr(), _nbytes(tensor), NCCL_UINT8, stream)
        return list(gathered.unbind(0))

    def reduce_scatter(self, ranks: tuple, chunks: list[torch.Tensor], reduce_op: str) -> torch.Tensor:
        if self._skips(ranks):
            return chunks[0].clone(memory_format=torch.contiguous_format)
        send = torch.stack(chunks)
        output = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
        kind, op = _reduction(output, reduce_op)
        with self._on_comm_stream(ranks, send, output) as (comm, stream):
            comm.reduceScatter(send.data_ptr(), output.data_ptr(), output.numel(), kind, op, stream)
        if reduce_op == "avg":
            output /= len(ranks)
        return output

    def all_to_all(self, ranks: tuple, send: torch.Tensor) -> torch.Tensor:
        """`send` stacks one equal-size piece per member on dim 0; returns the pieces received.
        cupy has no ncclAllToAll: one grouped send/recv pair per member does the same."""
        send = send.contiguous()
        if self._skips(ranks):
            return send.clone()
        receive = torch.empty_like(send)
        piece = _nbytes(send[0]) if len(send) else 0
        with self._on_comm_stream(ranks, send, receive) as (comm, stream):
            self._nccl.groupStart()
            try:
                for peer in range(len(ranks)):
                    comm.send(send[peer].data_ptr(), piece, NCCL_UINT8, peer, stream)
                    comm.recv(receive[peer].data_ptr(), piece, NCCL_UINT8, peer, stream)
            finally:
                self._nccl.groupEnd()
        return receive

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

    # --- stream ordering ------------------------------------------------------------------------
    def _on_comm_stream(self, ranks: tuple, *tensors: torch.Tensor):
        return _CommStreamScope(self, ranks, tensors)


class _CommStreamScope:
    """compute --event--> comm stream: the collective --event--> compute. No host waits."""

    def __init__(self, communicator: NcclCommunicator, ranks: tuple, tensors):
        self.communicator, self.ranks, self.tensors = communicator, ranks, tensors

    def __enter__(self):
        self.compute = torch.cuda.current_stream()
        inputs_ready = torch.cuda.Event()
        inputs_ready.record(self.compute)
        stream = self.communicator.stream
        stream.wait_event(inputs_ready)
        return self.communicator.group(self.ranks), stream.cuda_stream

    def __exit__(self, *failure) -> None:
        stream = self.communicator.stream
        for tensor in self.tensors:
            tensor.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
        self.compute.wait_event(done)
        self.communicator._watchdog.track(done, self.ranks)


def _reduction(tensor: torch.Tensor, reduce_op: str) -> tuple[int, int]:
    kind = NCCL_DATATYPES.get(tensor.dtype)
    if kind is None:
        legal = ", ".join(str(d).replace("torch.", "") for d in NCCL_DATATYPES)
        raise TypeError(f"NCCL cannot reduce {tensor.dtype} tensors (P({reduce_op}) -> R or S): "
                        f"reducible dtypes are {legal}; convert with .to(...) first")
    return kind, NCCL_REDUCE_OPS[reduce_op]


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
