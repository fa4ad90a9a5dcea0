"""How workers move data among themselves: the Communicator interface that the worker and its
kernels use, and its CPU implementation, GlooCommunicator (runtime/devices/nccl.py has the GPU one).

GlooCommunicator runs torch.distributed Gloo process groups, one per mesh-dim slice (a tuple of
ranks), created lazily on first use and cached.

No default (world) process group: each group is a ProcessGroupGloo on a PrefixStore of the
controller-hosted TCPStore, so the worker pool can grow without re-forming a world. Members create
a group at the same command (they run the same commands in order), which is what Gloo's
rendezvous needs. Tensor bytes never pass through the controller.

A lost peer must not hold the survivors: Gloo has no abort, so every wait is a loop of short
waits that checks, between them, whether the controller has marked a member lost (its key in
the store). The command then fails on this rank, the group is dropped for good, and the worker
goes on with its next command: meshes of surviving ranks keep working. Group creation waits for
every member in the store the same way before Gloo's own rendezvous starts.
"""
from __future__ import annotations

import datetime
import time
from typing import Protocol

import torch
import torch.distributed as dist

from ...errors import DTorchError
from .host_buffers import ScratchBuffers
from ..protocol import lost_worker_key

__all__ = ["Communicator", "GlooCommunicator", "PeerLostError", "REDUCE_OPS", "backend_reduce_op",
           "finish_reduction", "group_name", "holds_any", "real_view", "reducible"]

# --- reductions, the same on every backend -------------------------------------------------------
# Each reduce op is one primitive of the backend; avg has none of its own on either, so it is a
# sum, then a division by the group size (finish_reduction). A backend maps the primitives only.
REDUCE_OPS = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}


def backend_reduce_op(reduce_op: str, primitives: dict):
    """The backend's op for `reduce_op`; `primitives` maps "sum", "max" and "min" to the backend's."""
    return primitives[REDUCE_OPS[reduce_op]]


def finish_reduction(tensor: torch.Tensor, reduce_op: str, ranks: tuple) -> torch.Tensor:
    """What the primitive left to do, in place (on the current stream): avg divides the sum."""
    if reduce_op == "avg":
        tensor /= len(ranks)
    return tensor


# --- complex tensors, the same on every backend --------------------------------------------------
# Neither backend carries complex numbers (Gloo: "Invalid scalar type"; NCCL has no complex
# datatype), so every collective moves a complex tensor as its real view, torch.view_as_real: a
# trailing dim of 2 holding the real and imaginary parts, in the same memory. A sum of complex
# numbers is the sum of their parts, so sum and avg on that view are exactly complex sum and
# mean; max and min have no meaning on complex numbers (torch.amax refuses them too), and the
# controller refuses a complex P(max) or P(min) before anything is sent (tensor_meta.refuse_unordered).
def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or for a complex one its real view in the same memory (any strides)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def reducible(tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """real_view(tensor) for a reduction by `reduce_op`: a TypeError, before any member waits,
    for max or min of complex values (the controller's refusal makes this a last guard)."""
    if tensor.is_complex() and REDUCE_OPS[reduce_op] != "sum":
        raise TypeError(f"cannot reduce {tensor.dtype} tensors by {reduce_op}: complex numbers have no "
                        "order; only sum and avg reduce complex tensors")
    return real_view(tensor)


class Communicator(Protocol):
    """Collectives among workers, as the worker and kernels call them; GlooCommunicator (CPU) and
    nccl.NcclCommunicator (GPUs) have exactly these.

    `ranks` is a group: a tuple of worker ranks, in mesh order, that holds this worker's rank.
    Every member calls the same methods on the same group in the same order, with tensors of the
    same shape and dtype, on the communicator's device (CPU for Gloo, this worker's GPU for NCCL).
    `reduce_op` is a key of REDUCE_OPS: "sum", "avg", "max" or "min". A complex tensor travels
    as its real view (real_view) and reduces by sum or avg only (reducible).

    Failures: a collective whose peer is gone never holds the worker for good. Gloo raises
    PeerLostError on the members still waiting once the controller marks a peer lost or the
    timeout passes, and every later call on that group raises it at once. NCCL calls return as
    soon as they are enqueued on the current stream; a watchdog exits the worker when one does
    not finish within the timeout, a peer is lost, or NCCL reports an error (docs/design/cuda.md).
    """

    @property
    def host(self) -> Communicator:
        """The communicator over host memory (Gloo) among the same workers: the Gloo one itself.
        agree_max and moves between a CPU mesh and a CUDA mesh go over it."""

    def all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """`tensor` (contiguous) reduced elementwise over every member, with avg the sum divided
        by len(ranks). The result may be `tensor` itself, overwritten: use the returned tensor.
        NCCL raises TypeError, before any member waits, for a dtype it cannot reduce."""

    background_collectives: bool
    """Whether start_all_reduce runs beside the caller's other collectives of the same ranks:
    True for Gloo (a group of its own, and Gloo's own threads) and NCCL (a communicator and a
    stream of their own); False for the shared-GPU mode's staged Gloo, whose callers start it only
    after the rest."""

    def start_all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str):
        """all_reduce begun now, finished by calling what this returns (which returns what
        all_reduce would). Call prepare_background(ranks) at a point every member reaches alike
        first: creating a group waits for every member."""

    def prepare_background(self, ranks: tuple) -> None:
        """Create what start_all_reduce on `ranks` needs (collectively)."""

    def all_gather(self, ranks: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's `tensor`, stacked in member order on a new dim 0, in a new buffer."""

    def start_all_gather(self, ranks: tuple, tensor: torch.Tensor):
        """all_gather begun now on the same group, in the caller's order among its other
        collectives: (the buffer it fills, what finishes it). The buffer holds the result only
        once the finish has been called (fully_shard's prefetch: runtime/worker/fsdp_gather.py)."""

    def reduce_scatter(self, ranks: tuple, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """`stacked` holds one equal-size piece per member on dim 0, with any strides (the
        backend packs it where it likes). Returns, in a new tensor, piece i (i = this member's
        index in `ranks`) reduced over every member, as all_reduce does; NCCL raises TypeError
        as there."""

    def all_to_all(self, ranks: tuple, send: torch.Tensor) -> torch.Tensor:
        """`send` stacks one equal-size piece per member on dim 0, with any strides; piece i
        goes to member i. Returns a new contiguous tensor shaped like `send` whose piece i came
        from member i."""

    def exchange(self, ranks: tuple, sends: list, receives: list) -> None:
        """Point to point within `ranks`: `sends` and `receives` are (peer rank, contiguous
        tensor) pairs; each received tensor is written in place. All are posted before any is
        waited on, so no order among peers can deadlock. Every member calls it, even with
        nothing to move: the group is created collectively."""

    def agree_max(self, ranks: tuple, value: int) -> int:
        """The largest `value` any member passed, over host memory (a GPU never syncs for it):
        every rank of a move between meshes learns whether any rank failed its part."""

    def close(self) -> None:
        """Release every group without waiting for peers, which may be gone; NCCL also stops its
        watchdog and closes its host communicator. The worker calls it as it exits; a second
        call does no harm."""

    def regroup(self, generation: int, replaced: tuple) -> None:
        """Lost ranks `replaced` run in new processes now (dtorch.replace_lost_workers): drop
        every cached group that holds one (kept, never destroyed: destroying joins threads that
        wait for the dead peer), forget that such groups broke, and name groups created from here
        on with `generation`, so no member ever meets a rendezvous key of an older group. Every
        worker runs it at the same command; NCCL's leaves its host communicator to the worker."""


# --- Gloo ------------------------------------------------------------------------------------------
# How often a waiting collective or group creation looks for lost peers. A healthy collective
# finishes within the first wait, so this costs nothing on the normal path.
PEER_CHECK_S = 0.25
# After a Gloo error, how long to wait for the controller to mark a dead peer lost (it looks at
# process exits every 0.1 s): only then is the error a consequence of the loss.
LOSS_NOTICE_S = 1.0

GLOO_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# reduce_scatter's local reduction over the pieces all_to_all brought (member order, deterministic);
# the sum keeps the pieces' dtype (torch sums integers and bools into int64)
_GLOO_STACK_REDUCTIONS = {"sum": lambda t: t.sum(0, dtype=t.dtype), "max": lambda t: t.amax(0),
                          "min": lambda t: t.amin(0)}
# The dtypes Gloo carries; others (int16, uint16/32/64, float8) raise "Invalid scalar type". Moves
# carry those as their bytes (uint8, bit for bit), and reductions run in a type that holds every
# value, cast back after: an int16 sum then wraps as torch's own int16 arithmetic does. Complex
# tensors go as their real view (real_view), whose dtype is one of these.
_GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                          torch.int32, torch.int64, torch.bool})
_GLOO_REDUCES_IN = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64,
                    **{dtype: torch.float32 for dtype in (torch.float8_e4m3fn, torch.float8_e5m2,
                                                         torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}}


def _gloo_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of `tensor` (contiguous; complex as its real view); for a dtype Gloo lacks,
    of its bytes, as uint8."""
    flat = real_view(tensor).view(-1)
    return flat if flat.dtype in _GLOO_DTYPES else flat.view(torch.uint8)


def _gloo_reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in _GLOO_DTYPES:
        return dtype
    if dtype not in _GLOO_REDUCES_IN:
        raise TypeError(f"Gloo cannot reduce {dtype} tensors (a Partial -> R or S move, or a Partial "
                        f"result); convert with .to(torch.int64) or .to(torch.float64) first")
    return _GLOO_REDUCES_IN[dtype]


class GlooCommunicator:
    def __init__(self, store_address: str, rank: int, hostname: str, timeout_s: float = 300.0):
        host, port = store_address.rsplit(":", 1)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        self.rank, self.hostname = rank, hostname
        self._groups: dict[tuple, dist.ProcessGroup] = {}
        self._broken: dict[tuple, str] = {}
        self._abandoned: list = []
        self.generation = 0   # bumped by regroup after lost ranks are replaced
        self._renewals: list = []   # (members, tag): groups within them were abandoned mid-collective
        # While a Backward command runs: the store key a member sets when its own backward fails,
        # so the others stop waiting in that backward's collectives (Worker._backward_together)
        self.abort_key: str | None = None
        self._scratch = ScratchBuffers()

    @property
    def host(self) -> GlooCommunicator:
        """Gloo is the host channel already (see Communicator.host)."""
        return self

    def group(self, ranks: tuple, purpose: str = "") -> dist.ProcessGroup:
        """The group of `ranks` (created collectively on first use). `purpose` names a separate
        group of the same ranks, whose state no other traffic can disturb (settling a backward)."""
        key = (ranks, purpose) if purpose else ranks
        pg = self._groups.get(key)
        if pg is None:
            if ranks in self._broken:
                raise PeerLostError(self._broken[ranks])
            name = group_name(ranks, self.generation) + self._renewed(ranks) + (f"/{purpose}" if purpose else "")
            self._wait_for_members(name, ranks)
            prefix = dist.PrefixStore("gloo/" + name, self.store)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.hostname)]
            pg = dist.ProcessGroupGloo(prefix, ranks.index(self.rank), len(ranks), options)
            self._groups[key] = pg
        return pg

    def _renewed(self, ranks: tuple) -> str:
        members = set(ranks)
        tags = [tag for within, tag in self._renewals if members <= within]
        return f"/r{tags[-1]}" if tags else ""

    def renew(self, ranks: tuple, tag: int) -> None:
        """A backward among `ranks` was abandoned mid-collective on some members: every member
        drops its groups within `ranks` (kept, never destroyed) and names those it creates from
        now on with `tag`, so no group with a half-finished collective is used again."""
        members = set(ranks)
        for key in [k for k in self._groups if set(group_members(k)) <= members]:
            self._abandoned.append((self._groups.pop(key), None))
        self._renewals.append((frozenset(members), tag))

    def settle(self, ranks: tuple, failed: bool) -> bool:
        """Whether any member of `ranks` failed, over a group that carries nothing else (the
        backward's own groups may hold a collective some member abandoned)."""
        flag = torch.tensor([int(failed)], dtype=torch.int64)
        self._run(ranks, self.group(ranks, "settle").allreduce([flag], _allreduce_options("max")))
        return bool(flag.item())

    def _wait_for_members(self, name: str, ranks: tuple) -> None:
        """Every member has reached this group's creation (Gloo's own rendezvous would wait
        for a dead member until the timeout); the last to arrive opens the gate."""
        arrived, gate = f"dtorch/arrived/{name}", f"dtorch/gate/{name}"
        if self.store.add(arrived, 1) == len(ranks):
            self.store.set(gate, b"1")
        self._wait(ranks, lambda seconds: _poll_key(self.store, gate, seconds))

    def _run(self, ranks: tuple, work) -> None:
        self._wait(ranks, lambda seconds: _wait_work(work, seconds))

    def _wait(self, ranks: tuple, finished_within) -> None:
        """Until `finished_within(seconds)` says True; between tries, fail if the controller
        marked a member lost or the timeout has passed."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self._finished(ranks, finished_within):
            if self.abort_key is not None and self.store.check([self.abort_key]):
                self._abandoned.append((self._groups.pop(ranks, None), finished_within))
                raise BackwardAbandoned(f"another rank's backward failed; ranks {ranks} stop waiting for it")
            problem = self._lost_member(ranks) or (
                time.monotonic() > deadline and f"ranks {ranks} did not finish within {self.timeout}")
            if problem:
                self._break(ranks, problem, finished_within)

    def _finished(self, ranks: tuple, finished_within) -> bool:
        """One short wait. Gloo's own error when a peer's process died (connection reset) becomes
        PeerLostError once the controller marks the peer lost, as a wait that sees the key first
        would: the failure then reads as the loss's consequence, not a failure of its own."""
        try:
            return finished_within(PEER_CHECK_S)
        except RuntimeError as error:
            problem = self._lost_member_soon(ranks)
            if problem is None:
                raise
            self._break(ranks, problem, finished_within, error)

    def _break(self, ranks: tuple, problem: str, finished_within, cause=None):
        self._broken[ranks] = problem
        # Kept, never dropped: destroying a Gloo group (or its work) joins threads that
        # still wait for the lost peer, which would hang this worker after all.
        self._abandoned.append((self._groups.pop(ranks, None), finished_within))
        raise PeerLostError(problem) from cause

    def _lost_member_soon(self, ranks: tuple) -> str | None:
        """A lost member, waiting up to LOSS_NOTICE_S for the controller to notice a dead process."""
        deadline = time.monotonic() + LOSS_NOTICE_S
        while True:
            problem = self._lost_member(ranks)
            if problem or time.monotonic() > deadline:
                return problem
            time.sleep(0.05)

    def _lost_member(self, ranks: tuple) -> str | None:
        for peer in ranks:
            if peer != self.rank and self.store.check([lost_worker_key(peer)]):
                return f"peer rank {peer} of the group {ranks} is lost; this collective cannot finish"
        return None

    # --- collectives over one group; every member calls the same one -------------------------
    def all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        carried = reducible(tensor, reduce_op)
        wider = _gloo_reduction_dtype(carried.dtype)
        if wider is not carried.dtype:   # (never a complex tensor's view: float16 at the narrowest)
            return tensor.copy_(self.all_reduce(ranks, tensor.to(wider), reduce_op))
        self._run(ranks, self.group(ranks).allreduce([carried], _allreduce_options(reduce_op)))
        return finish_reduction(tensor, reduce_op, ranks)

    background_collectives = True

    def prepare_background(self, ranks: tuple) -> None:
        self.group(ranks, "background")

    def start_all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str):
        """On a group of `ranks` that carries only these, so they meet in their own order
        whatever the caller's other collectives do meanwhile (Gloo's threads run them)."""
        carried = reducible(tensor, reduce_op)
        wider = _gloo_reduction_dtype(carried.dtype)
        if wider is not carried.dtype:
            finish_wider = self.start_all_reduce(ranks, tensor.to(wider), reduce_op)
            return lambda: tensor.copy_(finish_wider())
        work = self.group(ranks, "background").allreduce([carried], _allreduce_options(reduce_op))

        def finish() -> torch.Tensor:
            self._run(ranks, work)
            return finish_reduction(tensor, reduce_op, ranks)
        return finish

    def all_gather(self, ranks: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's `tensor` (same shape everywhere), stacked on a new dim 0 in one buffer."""
        tensor = tensor.contiguous()
        gathered = tensor.new_empty((len(ranks),) + tuple(tensor.shape))
        # Gloo splits the output into one input-sized piece per member: flat views.
        self._run(ranks, self.group(ranks)._allgather_base(_gloo_bytes(gathered), _gloo_bytes(tensor)))
        return gathered

    def start_all_gather(self, ranks: tuple, tensor: torch.Tensor):
        """On the group every other collective of `ranks` uses: Gloo's threads run it while this
        one computes, and every member starts it at the same command, so the order holds."""
        tensor = tensor.contiguous()
        gathered = tensor.new_empty((len(ranks),) + tuple(tensor.shape))
        work = self.group(ranks)._allgather_base(_gloo_bytes(gathered), _gloo_bytes(tensor))
        return gathered, lambda: self._run(ranks, work)

    def reduce_scatter(self, ranks: tuple, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """`stacked` holds one equal-size piece per member on dim 0; returns this member's piece
        reduced over all members. Built on all_to_all (the same bytes): Gloo's own
        reduce_scatter ignores a wait's timeout, so a member waiting on a lost or failed peer
        could never look up and leave. The pieces received are reduced at once, so they land
        in a kept buffer too."""
        carried = reducible(stacked, reduce_op)   # complex: reduced as real parts, then viewed back
        received = self._all_to_all(ranks, carried, self._scratch.take("received", carried))
        reduced = _GLOO_STACK_REDUCTIONS[REDUCE_OPS[reduce_op]](received)
        if stacked.is_complex():
            reduced = torch.view_as_complex(reduced)
        return finish_reduction(reduced, reduce_op, ranks)

    def all_to_all(self, ranks: tuple, send: torch.Tensor) -> torch.Tensor:
        """`send` stacks one equal-size piece per member on dim 0; returns the pieces received."""
        return self._all_to_all(ranks, send, torch.empty(send.shape, dtype=send.dtype))

    def _all_to_all(self, ranks: tuple, send: torch.Tensor, receive: torch.Tensor) -> torch.Tensor:
        if not send.is_contiguous():   # packed into a kept buffer: a fresh one faults its pages in
            send = self._scratch.take("sent", send).copy_(send)
        # equal pieces of the flat buffers are the pieces on dim 0, so a byte view splits alike
        try:
            self._run(ranks, self.group(ranks).alltoall_base(_gloo_bytes(receive), _gloo_bytes(send), [], [],
                                                             dist.AllToAllOptions()))
        except BaseException:
            self._scratch.forget()   # an abandoned collective may still write into them
            raise
        return receive

    def exchange(self, ranks: tuple, sends: list, receives: list) -> None:
        """Point-to-point within the group `ranks`: sends/receives are (peer rank, tensor) pairs;
        all are posted before any is waited on, so no ordering between peers can deadlock."""
        pg = self.group(ranks)
        works = [pg.send([_gloo_bytes(tensor)], ranks.index(peer), 0) for peer, tensor in sends]
        works += [pg.recv([_gloo_bytes(tensor)], ranks.index(peer), 0) for peer, tensor in receives]
        for work in works:
            self._finish_point_to_point(ranks, work)

    def _finish_point_to_point(self, ranks: tuple, work) -> None:
        """One wait, the whole timeout long: Gloo closes the pair of a send or receive whose
        wait(timeout) expires ("Application timeout caused pair closure"), so the short waits
        collectives poll with would break a receiver waiting on a busy sender (a pipeline stage
        still in its backward). A peer that dies resets the connection: that error becomes
        PeerLostError once the controller marks the peer lost."""
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            problem = self._lost_member_soon(ranks)
            if problem is None:
                raise
            self._break(ranks, problem, None, error)

    def agree_max(self, ranks: tuple, value: int) -> int:
        """The largest `value` any member passed (used to agree on failures before moving data)."""
        flag = torch.tensor([value], dtype=torch.int64)
        self._run(ranks, self.group(ranks).allreduce([flag], _allreduce_options("max")))
        return int(flag.item())

    def regroup(self, generation: int, replaced: tuple) -> None:
        """See Communicator.regroup."""
        self.generation = generation
        for key in [k for k in self._groups if holds_any(group_members(k), replaced)]:
            self._abandoned.append((self._groups.pop(key), None))
        for ranks in [r for r in self._broken if holds_any(r, replaced)]:
            del self._broken[ranks]

    def close(self) -> None:
        for pg in self._groups.values():
            try:
                pg.abort()   # do not wait for peers that may be gone
            except RuntimeError:
                pass
        self._groups.clear()


def group_name(ranks: tuple, generation: int) -> str:
    """The group's name in the rendezvous store; generation 0 (no worker ever replaced) keeps
    the plain name."""
    name = "-".join(map(str, ranks))
    return f"g{generation}/{name}" if generation else name


def group_members(key: tuple) -> tuple:
    """The ranks of a cached group's key: `ranks`, or `(ranks, purpose)`."""
    return key[0] if key and type(key[0]) is tuple else key


def holds_any(ranks: tuple, replaced: tuple) -> bool:
    return any(r in ranks for r in replaced)


def _wait_work(work, seconds: float) -> bool:
    try:
        work.wait(datetime.timedelta(seconds=seconds))
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    # The short wait expired, then the work completed before is_completed() looked: a wait
    # with no timeout now returns at once, or raises the work's own error (a closed connection).
    work.wait()
    return True


def _poll_key(store, key: str, seconds: float) -> bool:
    """Whether `key` appears within `seconds` (store.wait would log a warning per timeout)."""
    deadline, pause = time.monotonic() + seconds, 0.0005
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return True


class PeerLostError(DTorchError):
    """A collective's peer is lost: raised on the surviving members instead of waiting."""


class BackwardAbandoned(DTorchError):
    """Another member's backward failed: this one stops waiting in a collective of it."""


def _allreduce_options(reduce_op: str) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = backend_reduce_op(reduce_op, GLOO_REDUCE_OPS)
    return options
