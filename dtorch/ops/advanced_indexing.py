"""PURE: advanced (tensor) indexing as ops: `index` (x[t]), `index_put` (x[t] = v, torch.index_put)
and `masked_scatter`. dtorch/dtensor/indexing.py turns the user's index (torch tensors, lists,
bool masks, DTensors) into the canonical one these ops take: a tuple of ints >= 0, None, Python
bools, slices as (start, stop, step) (WHOLE for `:`) and integer index tensors, one entry per
input dim or fewer (missing trailing dims are `:`; torch.index_put passes only tensors).

torch's semantics (python_variable_indexing.cpp): ints and 0-d index tensors select (the dim goes),
slices and None build an intermediate tensor, then the index tensors (a Python bool indexes a new
dim with arange(0 or 1)) broadcast together and their broadcast shape replaces the dims they index:
in place when those dims are adjacent, at the front when a slice or None separates them.

Rules, for one mesh dim:
  index          a dim no index tensor touches keeps its shard (only `:` on it); x R with index
                 tensors S(j) -> S(the result dim of j) (the other index tensors R, sliced to match);
                 x S(d) on an indexed dim with R index tensors -> P(sum) (P(max) for bool): each rank
                 picks the positions inside its block and zeros the rest (the vocabulary-split
                 embedding's trick; the kernel learns its block from a ShardRegion);
                 x Partial with R index tensors -> that Partial (selection copies elements)
  index_put      x S(d), d not indexed: values S(the region dim d becomes) or broadcast there;
                 x S(d), d indexed, R index tensors and values: each rank writes the positions inside
                 its block, no communication; x R: everything R (or a P(max|min|avg) value, as setitem);
                 x Partial: values the same Partial (or R for max/min/avg when not accumulating)
  masked_scatter x S(d) or R with mask and source R: each rank counts the mask's Trues before its
                 block (the whole mask is on every rank) and takes its part of source; x Partial
                 with the same Partial source (or R for max/min/avg)
"""
from __future__ import annotations

from typing import NamedTuple, cast

import torch

from ..spec.placements import Partial, Shard, ShardRegion, narrow_to_box
from ..errors import UnsupportedOpError
from .indexing import WHOLE
from .registry import OpRow, kernel, register_family
from .rules import Call, Decision, R, RuleRejected, TensorSlot, unshard_fix

__all__ = ["ADVANCED_INDEXING", "Layout", "layout", "index", "index_put", "torch_items"]


# --- where each dim goes ---------------------------------------------------------------------------
class Layout(NamedTuple):
    kept: dict           # input dim -> result dim, for dims a slice keeps
    fixed: frozenset     # input dims an int or a slice other than `:` picks from
    indexed: dict        # input dim -> k, for dims the k-th index tensor selects along (0-d ones too)
    block: int           # the result dim where the broadcast index shape starts
    block_shape: tuple   # the index tensors' broadcast shape (() without index tensors)
    ndim: int            # the result's ndim


def _is_tensor(item) -> bool:
    return isinstance(item, (TensorSlot, torch.Tensor))


def _is_slice(item) -> bool:
    return type(item) in (tuple, list)


def layout(items, ndim: int, shape_of=lambda tensor: tensor.shape) -> Layout:
    """torch's dim bookkeeping for x[items]; `shape_of(item)` gives an index tensor's shape."""
    inter: list[int | None] = []
    advanced, fixed, indexed, in_dim, k = [], set(), {}, 0, 0
    for item in items:
        if item is None:
            inter.append(None)
        elif type(item) is bool:       # before int: a bool indexes a new dim with arange(0 or 1)
            advanced.append((len(inter), (int(item),)))
            inter.append(None)
        elif _is_tensor(item):
            shape = tuple(shape_of(item))
            indexed[in_dim], k = k, k + 1
            if shape:                  # a 0-d index tensor selects like an int
                advanced.append((len(inter), shape))
                inter.append(in_dim)
            in_dim += 1
        else:
            if isinstance(item, int) or tuple(item) != WHOLE:
                fixed.add(in_dim)
            if not isinstance(item, int):
                inter.append(in_dim)
            in_dim += 1
    inter += range(in_dim, ndim)
    positions = [p for p, _ in advanced]
    block_shape = tuple(torch.broadcast_shapes(*[shape for _, shape in advanced])) if advanced else ()
    if positions and positions != list(range(positions[0], positions[-1] + 1)):
        start, rest = 0, [d for p, d in enumerate(inter) if p not in positions]
        before, after = [], rest
    else:
        start = positions[0] if positions else len(inter)
        before, after = inter[:start], inter[positions[-1] + 1:] if positions else []
    kept = {d: i for i, d in enumerate(before) if d is not None}
    kept.update({d: start + len(block_shape) + i for i, d in enumerate(after) if d is not None})
    return Layout(kept, frozenset(fixed), indexed, start, block_shape,
                  len(before) + len(block_shape) + len(after))


def _call_layout(call: Call) -> Layout:
    return layout(call.param(1, "indices"), len(call.inputs[0].shape),
                  lambda slot: call.inputs[slot.index].shape)


# --- the reference functions (also the meta inference and the kernels on whole dims) ----------------
def torch_items(items, on_meta: bool = False) -> tuple:
    """The canonical index as torch's own. On meta tensors a 0-d index tensor becomes 0: torch
    selects with its value, which a meta tensor does not have (the shape does not depend on it)."""
    out = []
    for item in items:
        if _is_slice(item):
            item = slice(*item)
        elif on_meta and isinstance(item, torch.Tensor) and item.ndim == 0:
            item = 0
        out.append(item)
    return tuple(out)


def index(input, indices):
    """x[indices] on whole tensors: torch.Tensor.__getitem__."""
    _refuse_bool_tensors("x[index]", indices)
    return input[torch_items(indices, input.device.type == "meta")]


def index_put(input, indices, values, accumulate=False):
    """torch.index_put, widened to the canonical index of x[index] = values (accumulate only with
    index tensors alone, as torch's index_put)."""
    _refuse_bool_tensors("index_put", indices)
    items = torch_items(indices, input.device.type == "meta")
    if accumulate:
        if not all(_is_tensor(item) for item in items):
            raise UnsupportedOpError("index_put(accumulate=True) takes index tensors only (torch's form)")
        values = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=input.dtype)
        return torch.index_put(input, items, values, accumulate=True)
    out = input.clone()
    out[items] = values
    return out


def _refuse_bool_tensors(op: str, items) -> None:
    if any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items):
        raise UnsupportedOpError(f"{op} with a DTensor bool mask: the result's shape depends on the mask's values "
                                 "(the controller never reads data); read the mask first with x[mask.to_torch()], "
                                 "or keep the shape with dtorch.where(mask, x, 0) / x.masked_fill(~mask, 0)")


# --- rules -------------------------------------------------------------------------------------------
_INDEX_LEGAL = ("R index tensors with x S(d) on a dim they do not index (only `:` there) -> S, on a dim they "
                "index -> P(sum); x R with index tensors S(j) -> S; x Partial with R index tensors; all R")


def _index_tensors(call: Call) -> list:
    return [item for item in call.param(1, "indices") if isinstance(item, TensorSlot)]


def _check_positions(call: Call, placements, legal: str) -> None:
    for slot in _index_tensors(call):
        if isinstance(placements[slot.index], Partial):
            raise RuleRejected(f"index tensors cannot be {placements[slot.index]!r}: positions are not summed; "
                               f"{unshard_fix(call, placements[slot.index], slot.index, name='index')}", legal)


def _x_sharded(call: Call, lay: Layout, dim: int, legal: str) -> None:
    """Refusals shared by index and index_put for x S(dim)."""
    if dim in lay.fixed:
        raise RuleRejected(f"an int or a slice other than `:` on sharded dim {dim} picks values some ranks "
                           f"hold only; {unshard_fix(call, Shard(dim))}", legal)


def _sharded_positions(call: Call, placements) -> list:
    return [slot for slot in _index_tensors(call) if isinstance(placements[slot.index], Shard)]


def _index_rule(call: Call, placements) -> Decision:
    _check_positions(call, placements, _INDEX_LEGAL)
    x, lay = placements[0], _call_layout(call)
    split = _sharded_positions(call, placements)
    if not isinstance(x, Shard) and not x.is_replicate():   # Partial x: selection copies elements
        if split:
            raise RuleRejected(f"a {x!r} input takes Replicate index tensors only", _INDEX_LEGAL)
        return Decision(placements, (x,))
    if isinstance(x, Shard):
        _x_sharded(call, lay, x.dim, _INDEX_LEGAL)
        if split:
            raise RuleRejected(f"the input S({x.dim}) and an index tensor are both split on this mesh dim",
                               _INDEX_LEGAL)
        if x.dim in lay.indexed:   # each rank picks what its block holds: a sum of disjoint parts
            return Decision(placements, (Partial("max" if call.inputs[0].dtype == torch.bool else "sum"),))
        return Decision(placements, (Shard(lay.kept[x.dim]),))
    return _split_positions(call, placements, lay, split)


def _split_positions(call: Call, placements, lay: Layout, split: list) -> Decision:
    """x R: index tensors split along one dim of their broadcast shape split the result there."""
    if not split:
        return Decision(placements, (R,))
    block_dims = set()
    for slot in split:
        shape, dim = call.inputs[slot.index].shape, placements[slot.index].dim
        block_dim = len(lay.block_shape) - len(shape) + dim
        if shape[dim] != lay.block_shape[block_dim]:
            raise RuleRejected(f"index tensor S({dim}) is split on a broadcast dim of size 1", _INDEX_LEGAL)
        block_dims.add(block_dim)
    if len(block_dims) > 1:
        raise RuleRejected("index tensors are split on different dims of their broadcast shape", _INDEX_LEGAL)
    block_dim = block_dims.pop()
    required = list(placements)
    for slot in _index_tensors(call):
        shape = call.inputs[slot.index].shape
        dim = block_dim - (len(lay.block_shape) - len(shape))
        if dim >= 0 and shape[dim] == lay.block_shape[block_dim] and placements[slot.index].is_replicate():
            required[slot.index] = Shard(dim)   # R -> S: a free local slice, so positions line up
    return Decision(tuple(required), (Shard(lay.block + block_dim),))


_PUT_LEGAL = ("R index tensors: x S(d) with d indexed and the value R; x S(d) with `:` on d and the value "
              "S(its result dim) or broadcast and R; all R; x and the value the same Partial")


def _values_slot(call: Call):
    """The input number of the values tensor, or None for a scalar value."""
    count = 1 + len(_index_tensors(call))
    return count if len(call.inputs) > count else None


def _index_put_rule(call: Call, placements) -> Decision:
    _check_positions(call, placements, _PUT_LEGAL)
    slot, x, lay = _values_slot(call), placements[0], _call_layout(call)
    value = placements[slot] if slot is not None else None
    if _sharded_positions(call, placements):
        raise RuleRejected("index tensors split over ranks would write some positions on some ranks only; "
                           "index_put takes Replicate index tensors", _PUT_LEGAL)
    accumulate = bool(call.param(3, "accumulate", False))
    if isinstance(x, Partial) or isinstance(value, Partial):
        return _partial_put(x, value, accumulate)
    if isinstance(value, Shard) and not isinstance(x, Shard):
        raise RuleRejected("a sharded value cannot be written into a Replicate target", _PUT_LEGAL)
    if x.is_replicate():
        return Decision(placements, (R,))
    _x_sharded(call, lay, x.dim, _PUT_LEGAL)
    if x.dim in lay.indexed or value is None:
        if value is not None and not value.is_replicate():
            raise RuleRejected(f"writing along sharded dim {x.dim} through index tensors takes a Replicate "
                               f"value (each rank writes what falls in its block), not {value!r}", _PUT_LEGAL)
        return Decision(placements, (x,))
    return _aligned_value(call, placements, lay, x.dim, slot)


# _partial_put's Decision has inputs None: _fill_inputs puts the placements as given there
_AS_GIVEN = cast(tuple, None)


def _partial_put(x, value, accumulate: bool) -> Decision:
    if isinstance(x, Partial):
        if value == x and (not accumulate or x.reduce_op in ("sum", "avg")):
            return Decision(_AS_GIVEN, (x,))
        # a repeated value: max/min/avg keep it when written, and commute with adding it
        if (value is None or value.is_replicate()) and x.reduce_op != "sum":
            return Decision(_AS_GIVEN, (x,))
        raise RuleRejected(f"a {x!r} target takes a value of the same Partial (or R for max, min and avg): any "
                           "other value would count once per rank", _PUT_LEGAL)
    if x.is_replicate() and (value.reduce_op == "avg" if accumulate else value.reduce_op != "sum"):
        return Decision(_AS_GIVEN, (value,))   # the rest repeats on every rank; repeated positions add up linearly
    raise RuleRejected(f"a {value!r} value needs a target of the same Partial (or R for max, min, avg)", _PUT_LEGAL)


def _aligned_value(call: Call, placements, lay: Layout, dim: int, slot: int) -> Decision:
    """x S(dim), `:` on dim: the value must be split the same way where it spans that dim."""
    spec, value = call.inputs[slot], placements[slot]
    value_dim = lay.kept[dim] - (lay.ndim - len(spec.shape))
    spans = value_dim >= 0 and spec.shape[value_dim] != 1
    if value == Shard(value_dim) and spans or value.is_replicate():
        required = list(placements)
        required[slot] = Shard(value_dim) if spans else value
        return Decision(tuple(required), (placements[0],))
    raise RuleRejected(f"the value's {value!r} does not line up with the target's S({dim}) (the value must be "
                       f"{'S(%d)' % value_dim if spans else 'R'} there)", _PUT_LEGAL)


_SCATTER_LEGAL = "x S(d) or R with mask and source R; x Partial with the same Partial source (R for max, min, avg)"


def _masked_scatter_rule(call: Call, placements) -> Decision:
    x, mask, source = placements
    if not mask.is_replicate():
        raise RuleRejected(f"a {mask!r} mask: the count of Trues before each block needs the whole mask",
                           _SCATTER_LEGAL)
    if isinstance(x, Partial) or isinstance(source, Partial):
        return _partial_put(x, source, False)
    if not source.is_replicate():
        raise RuleRejected(f"a {source!r} source: each rank takes elements from anywhere in it", _SCATTER_LEGAL)
    return Decision(placements, (x,))


def _fill_inputs(rule):
    """_partial_put answers without inputs: the placements as given."""
    def filled(call: Call, placements) -> Decision:
        decision = rule(call, placements)
        return decision if decision.inputs is not None else decision._replace(inputs=placements)
    return filled


# --- kernels for a sharded, indexed dim ----------------------------------------------------------------
def _local_hook(kernel_name: str, touches):
    def local(call: Call, required):
        lay_dims = touches(call)
        if any(isinstance(p, Shard) and p.dim in lay_dims for p in required[0]):
            return kernel_name, {"region": ShardRegion(call.inputs[0].shape, required[0]),
                                 "sizes": tuple(call.inputs[0].shape)}
        return call.op, {}
    return local


def _into_block(input, items, region, sizes):
    """The index on this rank's block: positions outside it point at one zero slot appended to
    each such dim (read: a zero; write: dropped with the slot). Returns (padded input, items,
    padded dims)."""
    offset, local = region
    items, in_dim, padded = list(items), 0, []
    for i, item in enumerate(items):
        if item is None or type(item) is bool:
            continue
        if isinstance(item, torch.Tensor) and local[in_dim] != sizes[in_dim]:
            size = sizes[in_dim]
            bad = (item < -size) | (item >= size)
            if bool(bad.any()):
                raise IndexError(f"index {item[bad].reshape(-1)[0].item()} is out of bounds for dimension "
                                 f"{in_dim} with size {size}")
            position = torch.where(item < 0, item + size, item) - offset[in_dim]
            items[i] = position.masked_fill((position < 0) | (position >= local[in_dim]), local[in_dim])
            padded.append(in_dim)
        in_dim += 1
    for dim in padded:
        slot = list(input.shape)
        slot[dim] = 1
        input = torch.cat([input, input.new_zeros(slot)], dim)
    return input, items, padded


@kernel("index_block")
def index_block(input, indices, *, region, sizes):
    padded, items, _ = _into_block(input, indices, region, sizes)
    return index(padded, items)


@kernel("index_put_block")
def index_put_block(input, indices, values, accumulate=False, *, region, sizes):
    padded, items, dims = _into_block(input, indices, region, sizes)
    out = index_put(padded, items, values, accumulate)
    for dim in dims:
        out = out.narrow(dim, 0, input.shape[dim])
    return out.contiguous()


@kernel("masked_scatter_block")
def masked_scatter_block(input, mask, source, *, region, sizes):
    """This rank's block of x.masked_scatter(mask, source): the whole mask (R) numbers every True."""
    whole = mask.expand(sizes)
    order = whole.reshape(-1).cumsum(0).reshape(sizes) - 1
    trues = int(order.reshape(-1)[-1]) + 1 if whole.numel() else 0
    if trues > source.numel():
        raise RuntimeError(f"masked_scatter: expected source to have at least {trues} elements, "
                           f"it has {source.numel()}")
    offset, local = region
    box_mask, box_order = narrow_to_box(whole, offset, local), narrow_to_box(order, offset, local)
    out = input.clone()
    out[box_mask] = source.reshape(-1)[box_order[box_mask]]
    return out


def _indexed_dims(call: Call):
    return _call_layout(call).indexed


ADVANCED_INDEXING = {
    "index": OpRow(index, _index_rule, _local_hook("index_block", _indexed_dims), method=False,
                   doc="x[t] with index tensors (use the operator; rules in dtorch/ops/advanced_indexing.py): a dim "
                       "no index tensor touches keeps its shard; x S(d) on an indexed dim with R index tensors -> "
                       "P(sum), each rank picking what its block holds; x R with split index tensors -> S"),
    "index_put": OpRow(index_put, _fill_inputs(_index_put_rule), _local_hook("index_put_block", _indexed_dims),
                       method=False,
                       doc="x[t] = v, x.index_put(indices, values, accumulate): x S(d) on an indexed dim with R "
                           "index tensors and value: each rank writes what falls in its block, no communication"),
    "masked_scatter": OpRow(torch.Tensor.masked_scatter, _fill_inputs(_masked_scatter_rule),
                            _local_hook("masked_scatter_block", lambda call: range(len(call.inputs[0].shape))),
                            doc="x S(d) with mask and source R: each rank numbers the whole mask's Trues and "
                                "takes its part of source"),
}
register_family("indexing", ADVANCED_INDEXING)
