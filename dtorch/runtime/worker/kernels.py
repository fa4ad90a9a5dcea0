"""What a worker computes for a command, on its local shard: factories, redistribute steps.

Every function here is given the mesh geometry and does its own local-shape arithmetic with the
same pure helpers the controller uses, so both sides agree on every shard boundary.
"""
from __future__ import annotations

import torch

from ...spec import rng
from ...spec.placements import (DeviceMesh, Partial, Replicate, chunk_bounds, holds_partial_sum_value,
                                local_region)
from ...spec.redistribute import step_kind
from ..devices.comm import Communicator

__all__ = ["make_factory", "apply_steps", "partial_identity", "DifferentiableStep", "pack_saved", "unpack_saved"]


# --- factories ------------------------------------------------------------------------------
def make_factory(kind: str, shape, dtype, mesh: DeviceMesh, placements, coordinate, args,
                 device) -> torch.Tensor:
    offset, local = local_region(shape, mesh, placements, coordinate)
    values = _FACTORIES[kind](shape, offset, local, dtype, args, device)
    return _as_partial(values, mesh, placements, coordinate)


def _filled(value):
    return lambda shape, offset, local, dtype, args, device: torch.full(local, value, dtype=dtype, device=device)


def _full(shape, offset, local, dtype, args, device):
    return torch.full(local, args[0], dtype=dtype, device=device)


def _arange(shape, offset, local, dtype, args, device):
    start, step = args
    positions = torch.arange(offset[0], offset[0] + local[0], dtype=torch.float64, device=device)
    return (start + positions * step).to(dtype)


def _linspace(shape, offset, local, dtype, args, device):
    # torch's vectorized kernel rounds differently from any closed form we could evaluate per
    # element, so each worker builds the 1-D range (O(steps), like arange) and keeps its slice:
    # bit-identical to torch.linspace.
    start, end = args
    return torch.linspace(start, end, shape[0], dtype=dtype, device=device).narrow(0, offset[0], local[0]).clone()


def _eye(shape, offset, local, dtype, args, device):
    rows = torch.arange(offset[0], offset[0] + local[0], device=device).unsqueeze(1)
    columns = torch.arange(offset[1], offset[1] + local[1], device=device).unsqueeze(0)
    return (rows == columns).to(dtype)


def _random(sampler):
    def make(shape, offset, local, dtype, args, device):
        seed, counter, *params = args
        index = rng.global_indices(shape, offset, local, device)
        return sampler(index, seed, counter, dtype, *params)
    return make


_FACTORIES = {
    "zeros": _filled(0), "ones": _filled(1), "empty": _filled(0), "full": _full, "arange": _arange,
    "linspace": _linspace, "eye": _eye,
    "rand": _random(rng.uniform), "randn": _random(rng.normal), "randint": _random(rng.integers),
}
FACTORY_KINDS = frozenset(_FACTORIES)


def _as_partial(values: torch.Tensor, mesh, placements, coordinate) -> torch.Tensor:
    """A factory value under P(sum) lives on coordinate 0 of that mesh dim; the others hold 0."""
    return values if holds_partial_sum_value(placements, coordinate) else torch.zeros_like(values)


def partial_identity(values: torch.Tensor, reduce_op: str, keep: bool) -> torch.Tensor:
    """R -> P(op): the value is kept where `keep`; elsewhere sum holds zeros, avg/max/min a copy."""
    if keep or reduce_op != "sum":
        return values
    return torch.zeros_like(values)


# --- redistribute steps ---------------------------------------------------------------------
def apply_steps(tensor: torch.Tensor, shape, mesh: DeviceMesh, placements, steps, rank: int,
                comm: Communicator, donated: bool = False) -> torch.Tensor:
    """Run redistribute steps (mesh_dim, before, after) in order on this rank's shard.

    `donated`: the controller will never read the source again (a temporary, protocol's
    Redistribute.donate), so an all-reduce may overwrite it rather than a copy, if no other
    tensor here shares its storage. A buffer an earlier step made is reduced in place anyway.

    A step that fails here but not on the peers (out of memory while padding, say) must not
    leave them waiting in its collective or a later one: this rank goes on with zeros through
    every collective it still owes, then raises. Its output is poisoned, so the peers' results,
    computed with those zeros, can never be read (see MoveCommands._stand_in)."""
    coordinate = mesh.coordinate_of(rank)
    placements = list(placements)
    source, donated = tensor, donated and _alone_in_storage(tensor)
    regathers = _only_gathers(steps, mesh)
    failure = None
    for mesh_dim, before, after in steps:
        if mesh.shape[mesh_dim] == 1:   # one rank: every placement holds the same local data
            placements[mesh_dim] = after
            continue
        step = _STEPS[step_kind(before, after)]
        if step is _all_reduce and not torch.is_grad_enabled() and (donated or not _shares_storage(tensor, source)):
            step = _all_reduce_in_place
        arguments = (before, after, _group_extents(shape, mesh, placements, coordinate, mesh_dim),
                     mesh.group_along(rank, mesh_dim), coordinate[mesh_dim])
        if failure is None:
            counted = _CountingComm(comm)
            try:
                if torch.is_grad_enabled():   # a recorded redistribute: the step with its dual
                    tensor = DifferentiableStep.apply(tensor, _ANCHOR, step, before, after, *arguments[2:], counted,
                                                      regathers)
                else:
                    tensor = step(tensor, *arguments, counted)
            except Exception as error:
                failure = error
                owed = _collectives_of(step, before, tensor) - counted.calls
                if counted.broken or (counted.calls and owed):
                    raise   # communication itself failed, or a step is half done: no way to finish it
                if owed:    # nothing issued yet: join this step's collectives with zeros
                    step(_zeros_of(tensor, shape, mesh, placements, coordinate), *arguments, comm)
        else:
            step(_zeros_of(tensor, shape, mesh, placements, coordinate), *arguments, comm)
        placements[mesh_dim] = after
    if failure is not None:
        raise failure
    return tensor


class _CountingComm:
    """The communicator, counting the collectives a step has issued and whether one raised."""

    def __init__(self, comm: Communicator):
        self.comm, self.calls, self.broken = comm, 0, False

    def __getattr__(self, name):
        method = getattr(self.comm, name)

        def counted(*args, **kwargs):
            self.calls += 1
            try:
                return method(*args, **kwargs)
            except Exception:
                self.broken = True
                raise
        return counted


def _collectives_of(step, before, tensor: torch.Tensor) -> int:
    if step in (_slice, _partialize):
        return 0
    if step in (_all_reduce, _all_reduce_in_place, _reduce_scatter) and _drops_nan(tensor, before.reduce_op):
        return 2
    return 1


# A fresh tensor's storage use count (its own TensorImpl, plus the storage object asking): a
# tensor that counts more has views or aliases that an in-place reduce would change too.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
_LONE_USE_COUNT = _storage_use_count(torch.empty(1).untyped_storage()._cdata) if _storage_use_count else 0


def _alone_in_storage(tensor: torch.Tensor) -> bool:
    """No other tensor (a view, an alias another id holds) shares this one's storage."""
    if _storage_use_count is None or tensor.requires_grad or tensor._base is not None:
        return False
    return _storage_use_count(tensor.untyped_storage()._cdata) <= _LONE_USE_COUNT


def _shares_storage(tensor: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether `tensor` may alias `source` (a slice of it, or it): only buffers that earlier
    steps made are private to this redistribute."""
    return tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


def _zeros_of(tensor: torch.Tensor, shape, mesh, placements, coordinate) -> torch.Tensor:
    """Zeros shaped like this rank's block under `placements` (what a step expects)."""
    return torch.zeros(local_region(shape, mesh, placements, coordinate)[1], dtype=tensor.dtype,
                       device=tensor.device)


def _group_extents(shape, mesh, placements, coordinate, mesh_dim) -> list[int]:
    """Each tensor dim's size across this mesh dim's group: only outer mesh dims' shards applied
    (the planner has already un-sharded inner mesh dims that split the same tensor dim)."""
    outer = [p if m < mesh_dim else Replicate() for m, p in enumerate(placements)]
    return local_region(shape, mesh, outer, coordinate)[1]


def _pad_to(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`tensor` with zeros after its end along `dim` up to `size`: itself (any strides) when it
    is that long already; the communicator packs what it sends."""
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim)


# torch.chunk pieces are full-size except at the end (a shorter last piece, then empty ones), so
# pieces zero-padded to the first one's size and laid end to end hold the whole dim at its start:
# splitting and joining are one reshape each, and no per-piece list. The stacked pieces are a view;
# the communicator packs them (Gloo into a buffer it keeps), so splitting copies at most once.
def _stack_pieces(tensor: torch.Tensor, dim: int, total: int, parts: int) -> torch.Tensor:
    """(parts, *piece): the torch.chunk pieces of `dim`, zero-padded to equal size, stacked (a
    view where no padding is needed)."""
    chunk = chunk_bounds(total, parts, 0)[1]
    padded = _pad_to(tensor, dim, chunk * parts)
    return padded.unflatten(dim, (parts, chunk)).movedim(dim, 0)


def _join_pieces(stacked: torch.Tensor, dim: int, total: int) -> torch.Tensor:
    """The inverse: pieces stacked on dim 0, laid end to end along `dim`, trimmed to `total`
    (a view when `dim` is 0)."""
    return stacked.movedim(0, dim).flatten(dim, dim + 1).narrow(dim, 0, total)


def _all_gather(tensor, before, after, extents, group, index, comm):
    dim, parts, total = before.dim, len(group), extents[before.dim]
    gathered = comm.all_gather(group, _pad_to(tensor, dim, chunk_bounds(total, parts, 0)[1]))
    return _join_pieces(gathered, dim, total)


def _all_reduce(tensor, before, after, extents, group, index, comm):
    """Into a copy: Gloo and NCCL reduce in place, and the source may still be read."""
    return _reduced(tensor, lambda: tensor.clone(memory_format=torch.contiguous_format), before, group, comm)


def _all_reduce_in_place(tensor, before, after, extents, group, index, comm):
    """Overwriting `tensor` (copied only if not contiguous): apply_steps picks it for a buffer
    no one else reads."""
    return _reduced(tensor, tensor.contiguous, before, group, comm)


def _reduced(tensor, buffer, before, group, comm):
    nan = torch.isnan(tensor).to(torch.uint8) if _drops_nan(tensor, before.reduce_op) else None
    reduced = comm.all_reduce(group, buffer(), before.reduce_op)
    if nan is not None:   # (the mask is made first: nothing but collectives between the two)
        reduced = reduced.masked_fill(comm.all_reduce(group, nan, "max").bool(), float("nan"))
    return reduced


def _reduce_scatter(tensor, before, after, extents, group, index, comm):
    dim, parts, total = after.dim, len(group), extents[after.dim]
    nan = None
    if _drops_nan(tensor, before.reduce_op):
        nan = _stack_pieces(torch.isnan(tensor).to(torch.uint8), dim, total, parts)
    mine = comm.reduce_scatter(group, _stack_pieces(tensor, dim, total, parts), before.reduce_op)
    if nan is not None:   # (the mask is made first: nothing but collectives between the two)
        mine = mine.masked_fill(comm.reduce_scatter(group, nan, "max").bool(), float("nan"))
    return mine.narrow(dim, 0, chunk_bounds(total, parts, index)[1])


def _drops_nan(tensor: torch.Tensor, reduce_op: str) -> bool:
    """Gloo's MAX/MIN ignore a NaN that comes from another rank, where torch.amax returns NaN:
    a second, one-byte-per-element collective carries where any rank saw one."""
    return reduce_op in ("max", "min") and tensor.is_floating_point()


def _all_to_all(tensor, before, after, extents, group, index, comm):
    """S(i) -> S(j): cut j into padded pieces, pad i to the chunk size, swap, trim the padding."""
    src, dst, parts = before.dim, after.dim, len(group)
    src_total, dst_total = extents[src], extents[dst]
    padded = _pad_to(tensor, src, chunk_bounds(src_total, parts, 0)[1])
    received = comm.all_to_all(group, _stack_pieces(padded, dst, dst_total, parts))
    return _join_pieces(received, src, src_total).narrow(dst, 0, chunk_bounds(dst_total, parts, index)[1])


def _slice(tensor, before, after, extents, group, index, comm):
    start, length = chunk_bounds(extents[after.dim], len(group), index)
    return tensor.narrow(after.dim, start, length)


def _partialize(tensor, before, after, extents, group, index, comm):
    return partial_identity(tensor, after.reduce_op, index == 0)


_STEPS = {"all_gather": _all_gather, "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
          "all_to_all": _all_to_all, "slice": _slice, "partialize": _partialize}


# --- backward: each step's dual --------------------------------------------------------------
# A gradient's placements are the duals of its tensor's (dtorch/autograd/placement_rules.py): Shard(d)
# stays Shard(d), Replicate's gradient is P(sum) (each rank's local uses contribute a part) and
# P(sum)'s is Replicate. So the backward of each step is the step between the dual placements,
# run the other way: an all-gather's is a reduce-scatter, an all-reduce's an all-reduce, a
# reduce-scatter's an all-gather, an all-to-all's the reverse all-to-all, a slice's zero-padding.
_SUM = Partial("sum")

# Every recorded step takes this leaf as a second input, so its output requires grad on every
# rank even where the local input does not: each rank then records the same communication
# nodes, and their duals meet in backward. (Its own gradient is never formed.)
_ANCHOR = torch.zeros((), requires_grad=True)


def _only_gathers(steps, mesh: DeviceMesh) -> bool:
    """Whether every step that moves data is an all-gather: then each rank of a gather's group
    holds the same tensor after it, makes the same views of it and saves them in the same ops,
    so backward may gather it again (a collective) instead of keeping it. A slice or a
    partialize after the gather leaves views on some ranks and copies or zeros on others
    (R -> P(sum) keeps the value on one rank only): a rank that gathered again would wait for
    peers that saved a copy."""
    return all(step_kind(before, after) == "all_gather"
               for mesh_dim, before, after in steps if mesh.shape[mesh_dim] > 1)


class DifferentiableStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, anchor, step, before, after, extents, group, index, comm, regathers=False):
        ctx.step, ctx.before, ctx.after, ctx.extents, ctx.group, ctx.index = step, before, after, extents, group, index
        ctx.comm, ctx.shape = comm.comm if isinstance(comm, _CountingComm) else comm, tensor.shape
        out = step(tensor, before, after, extents, group, index, comm)
        if _selects(before):   # max/min: which ranks held the winner is read from the values
            ctx.save_for_backward(tensor, out)
        if regathers and step is _all_gather and tensor.is_leaf and tensor.requires_grad:
            # a parameter's shard gathered (fsdp): backward gathers it again rather than keep it.
            # Marked on the storage's root tensor: ops save views of it (linear saves weight.t())
            _root(out)._dtorch_regather = _GatherStepAgain(tensor, before, after, extents, group, index, ctx.comm)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (_dual(ctx, grad),) + (None,) * 9


def _dual(ctx, grad: torch.Tensor) -> torch.Tensor:
    step, before, after, place = ctx.step, ctx.before, ctx.after, (ctx.extents, ctx.group, ctx.index, ctx.comm)
    if isinstance(after, Partial) and after.reduce_op != "sum":
        # R -> P(avg|max|min) gave every rank a copy. The gradient reaching a copy is already its
        # share of the whole: the reduction's own backward split it (avg: 1/n each; max|min: to
        # the winners, ties split), so summing the shares is the Replicate input's P(sum) gradient
        return grad
    if _selects(before):
        return _selected(ctx, grad, place)
    if step is _all_gather:
        return _reduce_scatter(grad, _SUM, before, *place)
    if step is _all_reduce:
        return _all_reduce(grad, before, after, *place)
    if step is _reduce_scatter:
        gathered = _all_gather(grad, after, Replicate(), *place)
        return gathered / len(ctx.group) if before.reduce_op == "avg" else gathered
    if step is _all_to_all:
        return _all_to_all(grad, after, before, *place)
    if step is _slice:
        padded = grad.new_zeros(ctx.shape)
        start = chunk_bounds(ctx.extents[after.dim], len(ctx.group), ctx.index)[0]
        padded.narrow(after.dim, start, grad.shape[after.dim]).copy_(grad)
        return padded
    return partial_identity(grad, "sum", ctx.index == 0)   # R -> P(sum): the rank that kept the value


def _selects(placement) -> bool:
    return isinstance(placement, Partial) and placement.reduce_op in ("max", "min")


def _selected(ctx, grad: torch.Tensor, place) -> torch.Tensor:
    """P(max|min) -> R or S(d): the whole gradient goes to the ranks whose part was the winner,
    split evenly where several ranks tie (as torch's amax splits it between equal values)."""
    source, out = ctx.saved_tensors
    if ctx.step is _all_reduce:
        whole, winner = _all_reduce(grad, _SUM, Replicate(), *place), out
    else:
        whole = _all_gather(grad, ctx.after, Replicate(), *place)
        winner = _all_gather(out, ctx.after, Replicate(), *place)
    hit = (source == winner).to(grad.dtype)
    count = _all_reduce(hit, _SUM, Replicate(), *place)
    return whole * hit / count.clamp_min(1)


# --- fsdp: gathered parameters are not kept for backward ------------------------------------
def saves_gathered(inputs: list) -> bool:
    """Whether a recorded op must save its tensors for backward through pack_saved / unpack_saved:
    one of its inputs is a gathered parameter or a view of one. Otherwise torch's own way (a
    Python hook per saved tensor costs ~2 us, and only fsdp needs one). A loop, not any() over a
    generator: this runs for every recorded op."""
    for tensor in inputs:
        if getattr(tensor if tensor._base is None else tensor._base, "_dtorch_regather", None) is not None:
            return True
    return False


def saving_gathered():
    """The saved-tensor hooks for an op that saves_gathered."""
    return torch.autograd.graph.saved_tensors_hooks(pack_saved, unpack_saved)


def pack_saved(tensor: torch.Tensor):
    """torch.autograd.graph.saved_tensors_hooks' pack: a gathered parameter is saved as the way
    to gather it again (its shard and the step), so it is freed after the forward that used it."""
    recipe = getattr(_root(tensor), "_dtorch_regather", None)
    if recipe is None:
        # Detached: a hook's result is held as is, and an op's own output (exp, tanh, sdpa save
        # theirs) would hold its grad_fn, which holds it: a cycle that no backward frees when the
        # graph is retained (pipeline stages), so every step's graph stayed. unpack gets the same
        # storage and version counter back; torch reattaches the grad_fn itself.
        return tensor.detach()
    return _Regather(recipe, (tensor.size(), tensor.stride(), tensor.storage_offset()))


def saving_gathered_storages(inputs: list):
    """saving_gathered for a fused training run (fusion.py). The compiled function saves the
    views it needs of a gathered parameter (a weight's transpose) as tensors built on its storage
    that are no longer views of it in torch's eyes (`_base` is None), so pack_saved would keep
    them whole; here a saved tensor is matched to the gathered parameter whose storage it shares."""
    recipes = {}
    for tensor in inputs:
        recipe = getattr(_root(tensor), "_dtorch_regather", None)
        if recipe is not None and tensor.untyped_storage().nbytes():
            recipes[tensor.untyped_storage().data_ptr()] = recipe

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        recipe = recipes.get(storage.data_ptr()) if storage.nbytes() else None
        if recipe is None:
            return pack_saved(tensor)
        return _Regather(recipe, (tensor.size(), tensor.stride(), tensor.storage_offset()))
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved)


def unpack_saved(packed):
    """... and unpack: backward gathers it again (every rank unpacks in the same node order)."""
    if type(packed) is not _Regather:
        return packed
    return _root(packed.recipe.gather_again()).as_strided(*packed.view)


def _root(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor._base is None else tensor._base


class _GatherStepAgain:
    """A redistribute's all-gather of a parameter's shard (DifferentiableStep), to run again."""
    __slots__ = ("shard", "before", "after", "extents", "group", "index", "comm")

    def __init__(self, shard, before, after, extents, group, index, comm):
        self.shard, self.before, self.after, self.extents = shard, before, after, extents
        self.group, self.index, self.comm = group, index, comm

    def gather_again(self) -> torch.Tensor:
        with torch.no_grad():   # the same step lays the gathered storage out the same way again
            return _all_gather(self.shard.detach(), self.before, self.after, self.extents, self.group, self.index,
                               self.comm)


class _Regather:
    """A saved gathered parameter: its recipe (an object whose gather_again() gives the gathered
    storage anew: _GatherStepAgain, fsdp_gather's group member) and the saved view of it."""
    __slots__ = ("recipe", "view")

    def __init__(self, recipe, view):
        self.recipe, self.view = recipe, view
