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
"""
from __future__ import annotations

import torch

from ...spec.placements import chunk_bounds
from ...ops.registry import kernel
from .kernels import _ANCHOR, _root, _stack_pieces

__all__ = ["fsdp_all_gather"]


@kernel("fsdp_all_gather", peers=True)
def fsdp_all_gather(*shards, peers, blocks, dims, dtype, device, regather=True, reduce_dtype=None, standin=False):
    """The gathered tensors of `shards`, in order, in `dtype` (a mixed-precision policy's
    param_dtype: the cast rides in the copy into the flat buffer). `blocks`: each one's (offset,
    shape) here once gathered (a resolved ShardRegion); `dims`: the tensor dim its fsdp shard
    splits; `device`: the mesh's device type, for stand-in zeros (else the shards' own device);
    `regather`: whether backward gathers again rather than keep them (reshard_after_forward);
    `reduce_dtype`: the gradients' reduce-scatter's dtype (default `dtype`); each shard's gradient
    comes back in the shard's own dtype. With `standin` (an input failed here), zeros stand in so
    that the peers' collective still completes."""
    layout = _Layout(blocks, dims, peers, dtype, device if standin else shards[0].device)
    if standin:
        shards = layout.zeros()
    if torch.is_grad_enabled():   # a recorded gather (RunOp.grad): one node, its dual one reduce-scatter
        return _GatheredGroup.apply(layout, peers, regather, reduce_dtype or dtype, _ANCHOR, *shards)
    return layout.gather(shards, peers)


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

    def gather(self, shards, peers) -> list:
        flat = torch.empty(self.length, dtype=self.dtype, device=self.device)
        for i, shard in enumerate(shards):
            piece, dim = flat[slice(*self.spans[i])].view(self.pieces[i]), self.dims[i]
            held = shard.shape[dim]
            piece.narrow(dim, 0, held).copy_(shard)
            piece.narrow(dim, held, piece.shape[dim] - held).zero_()
        gathered = peers.all_gather(flat)   # (members, length)
        return [self._copy_out(gathered, i) for i in range(len(self.shapes))]

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


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class _GatheredGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, peers, regather, reduce_dtype, anchor, *shards):
        ctx.set_materialize_grads(False)   # an unused parameter's gradient: zeros in the packing only
        ctx.layout, ctx.peers, ctx.reduce_dtype = layout, peers, reduce_dtype
        ctx.wanted = [shard.dtype if shard.requires_grad else None for shard in shards]
        gathered = layout.gather(shards, peers)
        ctx.again = None
        if regather and all(shard.is_leaf and shard.requires_grad for shard in shards):   # parameters' shards
            ctx.again = _GatherGroupAgain(layout, peers, shards)
            for i, tensor in enumerate(gathered):   # marked on the storage's root: ops save views of it
                _root(tensor)._dtorch_regather = _GroupMember(ctx.again, i)
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.again is not None:   # every op that saved a gathered parameter has run its backward
            ctx.again.forget()
        mine = ctx.layout.reduce_scatter(grads, ctx.peers, ctx.reduce_dtype)
        # an output forward never used has no gradient: its parameter's stays None, as in torch
        return (None,) * 5 + tuple(g.to(wanted) if wanted is not None and grad is not None else None
                                   for g, grad, wanted in zip(mine, grads, ctx.wanted))


class _GatherGroupAgain:
    """The group's gather, run again in backward at the first unpack of any member."""
    __slots__ = ("layout", "peers", "shards", "gathered")

    def __init__(self, layout, peers, shards):
        self.layout, self.peers, self.shards, self.gathered = layout, peers, shards, None

    def member(self, i: int) -> torch.Tensor:
        if self.gathered is None:
            with torch.no_grad():
                self.gathered = self.layout.gather([shard.detach() for shard in self.shards], self.peers)
            _forget_after_backward(self)
        return self.gathered[i]

    def forget(self) -> None:
        self.gathered = None


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
