"""A worker's side of fully_shard's gather (dtorch/nn/fsdp.py): every parameter a module manages,
gathered over the fsdp mesh dim by ONE all-gather, and their gradients reduce-scattered by ONE
collective in backward.

Why grouped: a collective costs a fixed latency on top of its bytes (on CPU workers a Gloo
all-gather among 4 processes costs milliseconds however small), and a Llama block holds nine
parameters. One collective per parameter made an fsdp4 training step 1.46x torch FSDP2's, which
groups the same way (its flat all-gather, then a copy out per parameter).

Layout: each rank lays its shards end to end in one flat buffer, each zero-padded along its
sharded dim to the torch.chunk piece size, so every rank's buffer has the same length; the
all-gather stacks the members' buffers; each parameter is copied out of its column of them. In
backward each gradient is cut into its members' pieces the same way, the pieces of every
gradient laid side by side, and one reduce-scatter gives each rank the sums of its own pieces.

A gathered parameter saved for backward is kept as the way to gather it again (kernels.pack_saved),
as a single redistribute's is; here the whole group is gathered again at its first unpack and
held until the group's own backward (the reduce-scatter) runs: by then every op that used the
gathered parameters has run its backward. Every rank unpacks in the same node order, so all of
them gather at the same moment.

Prefetch (docs/design/training.md, "Prefetch"): an all-gather may be begun ahead of its use and
finished later. In forward the controller decides (fsdp_start_gather, then fsdp_all_gather with
`prefetched`); in backward, where no command comes between nodes, a group's first gather again
begins the previous group's (_GatherGroupAgain.start).
"""
from __future__ import annotations

import weakref

import torch

from ...spec.placements import chunk_bounds
from ...ops.registry import kernel
from .kernels import _ANCHOR, _root, _stack_pieces

__all__ = ["fsdp_all_gather", "fsdp_start_gather", "fsdp_prefetch_stats"]


@kernel("fsdp_all_gather", peers=True)
def fsdp_all_gather(*inputs, peers, blocks, dims, dtype, device, regather=True, reduce_dtype=None,
                    prefetched=False, backward_prefetch=True, standin=False):
    """The gathered tensors of the shards among `inputs`, in order, in `dtype` (a mixed-precision
    policy's param_dtype: the cast rides in the copy into the flat buffer). `blocks`: each one's
    (offset, shape) here once gathered (a resolved ShardRegion); `dims`: the tensor dim its fsdp
    shard splits; `device`: the mesh's device type, for stand-in zeros (else the shards' own
    device); `regather`: whether backward gathers again rather than keep them
    (reshard_after_forward); `reduce_dtype`: the gradients' reduce-scatter's dtype (default
    `dtype`); each shard's gradient comes back in the shard's own dtype. With `prefetched`, the
    last input is fsdp_start_gather's buffer: its all-gather is finished, not run again.
    `backward_prefetch`: whether this group's gather again in backward begins the previous
    group's (_GatherGroupAgain). With `standin` (an input failed here), zeros stand in so that
    the peers' collective still completes (a prefetched one was begun already: nothing more to
    do here)."""
    shards, started = (inputs[:-1], inputs[-1]) if prefetched else (inputs, None)
    layout = _Layout(blocks, dims, peers, dtype, device if standin else shards[0].device)
    if standin:
        shards = layout.zeros()
        if prefetched:
            started = torch.zeros((layout.parts, layout.length), dtype=dtype, device=layout.device)
    if torch.is_grad_enabled():   # a recorded gather (RunOp.grad): one node, its dual one reduce-scatter
        return _GatheredGroup.apply(layout, peers, (regather, backward_prefetch), reduce_dtype or dtype, started,
                                    _ANCHOR, *shards)
    return layout.gather(shards, peers, started)


@kernel("fsdp_start_gather", peers=True)
def fsdp_start_gather(*shards, peers, blocks, dims, dtype, device, standin=False):
    """fully_shard's forward prefetch (dtorch/nn/fsdp.py): the all-gather of `shards` (arguments
    as fsdp_all_gather's) begun now, so that it runs while the ops before the group's own gather
    compute. Returns the buffer it fills; the group's fsdp_all_gather (`prefetched`) finishes it
    and copies the parameters out. On CPU Gloo's threads run it; on a GPU it is enqueued on the
    communication stream like every collective."""
    layout = _Layout(blocks, dims, peers, dtype, device if standin else shards[0].device)
    if standin:   # the peers' all-gather needs this rank's part; its output is failed here, never read
        return _finished(layout.start(layout.zeros(), peers))
    return layout.start(shards, peers)


class _Layout:
    """Where each parameter's piece sits in the flat buffer every member sends."""

    def __init__(self, blocks, dims, peers, dtype, device):
        self.parts, self.index, self.dims, self.dtype, self.device = peers.size, peers.index, dims, dtype, device
        self.shapes, self.pieces, self.spans = [], [], []
        start = 0
        for (_, shape), dim in zip(blocks, dims):
            piece = list(shape)
            piece[dim] = chunk_bounds(shape[dim], self.parts, 0)[1]
            count = _numel(piece)
            self.shapes.append(list(shape))
            self.pieces.append(piece)
            self.spans.append((start, start + count))
            start += count
        self.length = start

    def held(self, i: int) -> int:
        """How much of parameter i's sharded dim this rank holds (torch.chunk's split)."""
        return chunk_bounds(self.shapes[i][self.dims[i]], self.parts, self.index)[1]

    def zeros(self) -> list:
        shards = []
        for i, shape in enumerate(self.shapes):
            shard = list(shape)
            shard[self.dims[i]] = self.held(i)
            shards.append(torch.zeros(shard, dtype=self.dtype, device=self.device))
        return shards

    def gather(self, shards, peers, started=None) -> list:
        """The parameters whole; `started`: start()'s buffer, its all-gather yet to be finished."""
        if started is None:
            gathered = peers.all_gather(self._pack(shards))   # (members, length)
        else:
            gathered = _finished(started)
        return [self._copy_out(gathered, i) for i in range(len(self.shapes))]

    def start(self, shards, peers) -> torch.Tensor:
        """The all-gather of `shards` begun: the (members, length) buffer it fills, which carries
        what finishes it (gather(started=...) calls that once)."""
        gathered, finish = peers.start_all_gather(self._pack(shards))
        _note_started(gathered, finish)
        return gathered

    def _pack(self, shards) -> torch.Tensor:
        flat = torch.empty(self.length, dtype=self.dtype, device=self.device)
        for i, shard in enumerate(shards):
            piece, dim = flat[slice(*self.spans[i])].view(self.pieces[i]), self.dims[i]
            held = shard.shape[dim]
            piece.narrow(dim, 0, held).copy_(shard)
            piece.narrow(dim, held, piece.shape[dim] - held).zero_()
        return flat

    def _copy_out(self, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i whole: its members' pieces end to end along its dim, in a buffer of its own
        (narrowed where the pieces' padding runs past its end)."""
        piece, dim, total = self.pieces[i], self.dims[i], self.shapes[i][self.dims[i]]
        pieces = gathered[:, slice(*self.spans[i])].unflatten(1, piece)   # (members, *piece)
        padded = list(piece)
        padded[dim] = piece[dim] * self.parts
        out = torch.empty(padded, dtype=self.dtype, device=self.device)
        out.unflatten(dim, (self.parts, piece[dim])).copy_(pieces.movedim(0, dim))
        return out if padded[dim] == total else out.narrow(dim, 0, total)

    def reduce_scatter(self, grads, peers, dtype) -> list:
        """Each rank's shard of every gradient, summed over the members in `dtype` (None: no
        gradient)."""
        packed = torch.empty((self.parts, self.length), dtype=dtype, device=self.device)
        for i, grad in enumerate(grads):
            pieces = packed[:, slice(*self.spans[i])].unflatten(1, self.pieces[i])
            if grad is None:
                pieces.zero_()
            else:
                pieces.copy_(_stack_pieces(grad, self.dims[i], self.shapes[i][self.dims[i]], self.parts))
        mine = peers.reduce_scatter(packed)   # (length,)
        return [mine[slice(*self.spans[i])].view(self.pieces[i]).narrow(self.dims[i], 0, self.held(i))
                for i in range(len(self.shapes))]


def _finished(started: torch.Tensor) -> torch.Tensor:
    """start()'s buffer once its all-gather is done (a stand-in's zeros have nothing to finish)."""
    finish = _IN_FLIGHT.pop(id(started), None)   # (a second gather of the same buffer must not wait again)
    if finish is not None:
        finish()
    return started


# The all-gathers begun ahead of their use and not finished yet, by their buffer's id: what
# finishes each. A dropped buffer takes its entry with it (a weakref.finalize): the groups a
# worker holds beyond the one it computes with; fsdp_prefetch_stats reads it, tests bound it.
# The finish is kept here, not on the buffer: the collective's work holds the buffer's storage,
# and torch keeps a tensor's Python object (with what its __dict__ holds) alive as long as its
# storage lives, so a finish on the buffer was a cycle through C++ that no collection breaks,
# one buffer a step for a backward prefetch that was begun and dropped unfinished.
_IN_FLIGHT: dict = {}
_MOST_IN_FLIGHT = [0]


def fsdp_prefetch_stats() -> dict:
    """How many prefetched all-gathers this worker has begun and not finished, now ("held"),
    and the most at once since the last call ("most"; the count restarts)."""
    stats = {"held": len(_IN_FLIGHT), "most": max(_MOST_IN_FLIGHT[0], len(_IN_FLIGHT))}
    _MOST_IN_FLIGHT[0] = 0
    return stats


def _note_started(gathered: torch.Tensor, finish) -> None:
    key = id(gathered)
    _IN_FLIGHT[key] = finish
    weakref.finalize(gathered, _IN_FLIGHT.pop, key, None)
    _MOST_IN_FLIGHT[0] = max(_MOST_IN_FLIGHT[0], len(_IN_FLIGHT))


@kernel("fsdp_prefetch_stats")
def fsdp_prefetch_stats_kernel(device):
    """fsdp_prefetch_stats as a tensor (held, most): what a test reads from every rank."""
    stats = fsdp_prefetch_stats()
    return torch.tensor([stats["held"], stats["most"]], dtype=torch.int64, device=device)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class _GatheredGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, peers, again, reduce_dtype, started, anchor, *shards):
        ctx.set_materialize_grads(False)   # an unused parameter's gradient: zeros in the packing only
        ctx.layout, ctx.peers, ctx.reduce_dtype = layout, peers, reduce_dtype
        ctx.wanted = [shard.dtype if shard.requires_grad else None for shard in shards]
        gathered = layout.gather(shards, peers, started)
        ctx.again = None
        regather, prefetch_previous = again
        if regather and all(shard.is_leaf and shard.requires_grad for shard in shards):   # parameters' shards
            ctx.again = _GatherGroupAgain(layout, peers, shards, prefetch_previous)
            for i, tensor in enumerate(gathered):   # marked on the storage's root: ops save views of it
                _root(tensor)._dtorch_regather = _GroupMember(ctx.again, i)
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.again is not None:   # every op that saved a gathered parameter has run its backward
            ctx.again.finish_backward()
        mine = ctx.layout.reduce_scatter(grads, ctx.peers, ctx.reduce_dtype)
        # an output forward never used has no gradient: its parameter's stays None, as in torch
        return (None,) * 6 + tuple([g.to(wanted) if wanted is not None and grad is not None else None
                                   for g, grad, wanted in zip(mine, grads, ctx.wanted)])


class _GatherGroupAgain:
    """The group's gather, run again in backward at the first unpack of any member.

    Backward prefetch: that first unpack also begins the all-gather of the group gathered just
    before this one in forward (`previous`), whose backward comes next, so that it runs while
    this group's backward computes; the forward order is the same on every rank, so they all
    begin it at the same unpack. At most two groups are held at once: this one, gathered, and
    the one begun (this one is dropped when its own node runs, before the previous group's ops'
    backward: autograd runs the later-recorded node first)."""
    __slots__ = ("layout", "peers", "shards", "gathered", "started", "previous", "done", "__weakref__")

    def __init__(self, layout, peers, shards, prefetch_previous: bool = True):
        self.layout, self.peers, self.shards, self.gathered, self.started = layout, peers, shards, None, None
        previous = _link_in_forward_order(self)   # (linked even when not followed: the next group may)
        self.previous, self.done = previous if prefetch_previous else None, False

    def member(self, i: int) -> torch.Tensor:
        if self.gathered is None:
            with torch.no_grad():
                self.gathered = self.layout.gather(self._detached(), self.peers, self.started)
            self.started = None
            _forget_after_backward(self)
            previous = self.previous() if self.previous is not None else None
            if previous is not None:
                previous.start()
        return self.gathered[i]

    def start(self) -> None:
        """Begin this group's gather again now (the group after it in forward is in backward)."""
        if self.gathered is None and self.started is None and not self.done:
            with torch.no_grad():
                self.started = self.layout.start(self._detached(), self.peers)
            _forget_after_backward(self)

    def _detached(self) -> list:
        return [shard.detach() for shard in self.shards]

    def forget(self) -> None:
        if self.started is not None:   # begun for a backward that did not come to it: finish, so the
            _finished(self.started)    # collective's work lets go of the buffer (every member began it)
        self.gathered = self.started = None

    def finish_backward(self) -> None:
        """The group's own node ran: nothing needs it gathered again in this backward."""
        self.forget()
        self.done = True


# The group gathered last in forward on this worker (a weak reference): the next one links to it.
_LAST_GATHERED: list = [None]


def _link_in_forward_order(group: _GatherGroupAgain):
    """The group gathered before `group` in this forward (a weak reference, or None); a gather
    inside a backward (a checkpointed region's recompute) joins no order: its backward is now."""
    if torch._C._current_autograd_node() is not None:
        return None
    previous = _LAST_GATHERED[0]
    _LAST_GATHERED[0] = weakref.ref(group)
    return previous


def _forget_after_backward(group: _GatherGroupAgain) -> None:
    """Drop what `group` gathered again at the end of this backward pass too: a backward that
    never reaches the group's own node (autograd.grad with respect to an input only, the graph
    retained) would otherwise hold it as long as the graph lives. Outside a backward (a saved
    tensor read by hand) the group's node still drops it."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(group.forget)
    except RuntimeError:
        pass


class _GroupMember:
    """kernels.pack_saved's recipe for member `index` of a gathered group."""
    __slots__ = ("group", "index")

    def __init__(self, group: _GatherGroupAgain, index: int):
        self.group, self.index = group, index

    def gather_again(self) -> torch.Tensor:
        return self.group.member(self.index)
