"""PURE: indexing ops. Selecting elements never combines them, so R -> R and a Partial input
passes as long as the positions come from a Replicate operand; what cannot work locally is
selecting along a sharded dim, where the wanted values live on other ranks.

  getitem        x[ints, slices, None, ...]: a sharded dim takes only a whole slice `:`
                 (tensor indices: the index / index_put ops of ops/advanced_indexing.py)
  narrow         S(d) off the narrowed dim
  index_select   source S(d) off dim with index R -> S(d); source R with index S(0) -> S(dim)
  gather         source and index sharded alike off dim (R sliced to match) -> that S;
                 source R with index S(dim) -> S(dim); Partial source with R index -> Partial
  scatter        every tensor sharded alike off dim (R sliced to match); Partial input and src
                 of the same kind with R index -> that Partial (each rank writes its share)
  topk, sort     S(d) off the op's dim; no Partial (they compare values)
  kthvalue, median, nanmedian, mode
                 the same along their dim (gone from the result unless keepdim); median(x) and
                 nanmedian(x) without a dim compare every element: Replicate only (outside strict
                 mode dtorch gathers a sharded input first)
"""
from __future__ import annotations

import operator

import torch

from ..distributed_spec import Partial, Shard
from ..errors import UnsupportedOpError
from .registry import OpRow, register_family
from .rules import (Call, Decision, R, RuleRejected, common_shard_dim, follow_rule, normalize_dim, off_dim,
                    unshard_fix)

__all__ = ["INDEXING", "AdvancedIndex", "canonical_index", "getitem"]

WHOLE = (None, None, None)  # a slice `:` over the whole dim


# --- x[index] ----------------------------------------------------------------------------------
def canonical_index(index, shape) -> tuple:
    """x[index] as a hashable tuple (plans are cached by it), one entry per input dim or new dim:
    an int >= 0 (the dim is dropped), None (a new dim), or (start, stop, step) from slice.indices,
    WHOLE for a slice that keeps the whole dim. Ellipsis is expanded; bounds errors raise
    IndexError as torch does (which also ends `for row in x`)."""
    items = tuple(map(_check_item, index if type(index) is tuple else (index,)))
    consumed = sum(item is not None and item is not Ellipsis for item in items)
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if consumed > len(shape):
        raise IndexError(f"too many indices for a DTensor of dimension {len(shape)}")
    fill = (slice(None),) * (len(shape) - consumed)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + fill + items[at + 1:]
    else:
        items = items + fill
    dims = iter(enumerate(shape))
    return tuple(None if item is None else _canonical_item(item, *next(dims)) for item in items)


class AdvancedIndex(Exception):
    """Raised by canonical_index for an index with tensors, lists or bools: the caller takes the
    advanced path (dtorch/advanced_indexing.py, ops/advanced_indexing.py) instead of getitem's."""


def _check_item(item):
    """The item itself, or an int for int-like ones (numpy ints); AdvancedIndex for tensors (a
    DTensor has `_meta`), lists, bools and arrays."""
    if item is None or item is Ellipsis or isinstance(item, slice) or type(item) is int:
        return item
    if isinstance(item, (bool, list, torch.Tensor)) or hasattr(item, "_meta") or getattr(item, "ndim", 0):
        raise AdvancedIndex(item)
    if hasattr(type(item), "__index__"):
        return operator.index(item)
    raise UnsupportedOpError(f"DTensor indexing takes ints, slices, None, Ellipsis, index tensors, lists and "
                             f"bool masks, not {type(item).__name__}")


def _canonical_item(item, dim: int, size: int):
    if isinstance(item, int):
        if not -size <= item < size:
            raise IndexError(f"index {item} is out of bounds for dimension {dim} with size {size}")
        return item % size
    start, stop, step = item.indices(size)
    if step <= 0:
        raise ValueError("step must be greater than zero")
    return WHOLE if (start, stop, step) == (0, size, 1) else (start, stop, step)


def getitem(input, index):
    """The reference and the local kernel: a canonical index (lists on the wire) back to torch's."""
    return input[tuple(item if item is None or isinstance(item, int) else slice(*item) for item in index)]


def _getitem_out_dim(call: Call, dim: int) -> int:
    in_dim = out_dim = 0
    for item in call.param(1, "index"):
        if item is not None and in_dim == dim:
            if item == WHOLE:
                return out_dim
            what = f"index {item}" if isinstance(item, int) else f"slice {slice(*item)}"
            raise RuleRejected(f"{what} on sharded dim {dim} selects values that live on some ranks "
                               f"only; {unshard_fix(call, Shard(dim))}", "a whole slice `:` on sharded dims")
        in_dim += item is not None
        out_dim += not isinstance(item, int)
    return out_dim + dim - in_dim


# --- selection by a tensor of positions ----------------------------------------------------------
_INDEX_SELECT_LEGAL = ("source S(d) off dim with index R; source R with index S(0) (gives S(dim)); "
                       "Partial source with index R; all R")


def _reject_partial_positions(call: Call, placement, input_index: int, legal: str) -> None:
    if isinstance(placement, Partial):
        raise RuleRejected(f"positions cannot be {placement!r}: "
                           f"{unshard_fix(call, placement, input_index, name='index')}", legal)


def _index_select_rule(call: Call, placements) -> Decision:
    source, index = placements
    _reject_partial_positions(call, index, 1, _INDEX_SELECT_LEGAL)
    dim = normalize_dim(call.param(1, "dim"), len(call.inputs[0].shape))
    if isinstance(source, Shard) and source.dim == dim:
        raise RuleRejected(f"selecting along sharded dim {dim} reads rows other ranks hold; "
                           f"{unshard_fix(call, source)}", _INDEX_SELECT_LEGAL)
    if source.is_replicate():
        return Decision(placements, (Shard(dim) if isinstance(index, Shard) else R,))
    if not index.is_replicate():
        raise RuleRejected(f"a {source!r} source needs a Replicate index, not {index!r}", _INDEX_SELECT_LEGAL)
    return Decision(placements, (source,))


_GATHER_LEGAL = ("source and index S(d) off dim (R sliced to match, sizes on d equal); source R with "
                 "index S(dim); Partial source with index R; all R")


def _gather_rule(call: Call, placements) -> Decision:
    source, index = placements
    _reject_partial_positions(call, index, 1, _GATHER_LEGAL)
    dim = normalize_dim(call.param(1, "dim"), len(call.inputs[0].shape))
    if isinstance(source, Partial):
        if not index.is_replicate():
            raise RuleRejected(f"a {source!r} source needs a Replicate index", _GATHER_LEGAL)
        return Decision(placements, (source,))
    if isinstance(source, Shard) and source.dim == dim:
        raise RuleRejected(f"gathering along sharded dim {dim} reads rows other ranks hold; "
                           f"{unshard_fix(call, source)}", _GATHER_LEGAL)
    if isinstance(index, Shard) and index.dim == dim and source.is_replicate():
        return Decision(placements, (index,))  # each rank gathers its rows of the index from all of source
    return _aligned(call, placements, dim, _GATHER_LEGAL)


def _aligned(call: Call, placements, dim: int, legal: str) -> Decision:
    """Every tensor sharded on the same dim d != dim, Replicate ones sliced to match: position i
    along d of the index then meets position i of the source on the same rank."""
    d = common_shard_dim(placements, legal)
    if d is None:
        return Decision(placements, (R,))
    if d == dim:
        raise RuleRejected(f"{call.op} along sharded dim {d} reaches positions other ranks hold", legal)
    sizes = {spec.shape[d] for spec in call.inputs}
    if len(sizes) > 1:
        raise RuleRejected(f"the tensors' sizes on sharded dim {d} differ ({sorted(sizes)}), so their "
                           f"shards would not line up", legal)
    return Decision((Shard(d),) * len(placements), (Shard(d),))


_SCATTER_LEGAL = ("every tensor S(d) off dim (R sliced to match, sizes on d equal); input and src the "
                  "same Partial with index R (no reduce=); all R")


def _scatter_rule(call: Call, placements) -> Decision:
    dim = normalize_dim(call.param(1, "dim"), len(call.inputs[0].shape))
    if any(isinstance(p, Partial) for p in placements):
        # input and src with the same Partial: each rank writes its share of src over its share of input
        if (len(placements) == 3 and isinstance(placements[0], Partial) and placements[2] == placements[0]
                and placements[1].is_replicate() and call.kwargs.get("reduce") is None):
            return Decision(placements, (placements[0],))
        raise RuleRejected("scatter takes a Partial only as input and src of the same kind with a "
                           "Replicate index (a value or R operand would count once per rank)", _SCATTER_LEGAL)
    return _aligned(call, placements, dim, _SCATTER_LEGAL)


# --- comparisons along one dim -------------------------------------------------------------------
_COMPARE_LEGAL = "S(d) off the op's dim, R"
_WHY = "it compares values other ranks hold"


def _compared_away(position: int):
    """out_dim_of for kthvalue, median, mode: topk's rule, but their dim leaves the result
    unless keepdim, so later shards shift down."""
    def out_dim_of(call: Call, dim: int) -> int:
        drops = len(call.out_shape) < len(call.inputs[0].shape)
        return off_dim(position, -1, _WHY, drops=drops, legal=_COMPARE_LEGAL)(call, dim)
    return out_dim_of


_WHOLE_LEGAL = "R (without a dim it compares every element)"
_ALONG_DIM_AT_1 = follow_rule(_compared_away(1), _COMPARE_LEGAL, partial_ok=False)   # median(x, dim), mode


def _every_element_or_along_dim(call: Call, placements) -> Decision:
    """median(x) / nanmedian(x): one value of every element, which no rank holds alone, so the
    input must be Replicate; median(x, dim) compares along its dim as kthvalue does."""
    if call.param(1, "dim") is not None:
        return _ALONG_DIM_AT_1(call, placements)
    (p,) = placements
    if not p.is_replicate():
        raise RuleRejected(f"{call.op} without a dim compares every element, and a {p!r} input holds "
                           f"them on several ranks: {unshard_fix(call, p)}", _WHOLE_LEGAL)
    return Decision(placements, (R,) * len(call.outputs))


# --- the table ---------------------------------------------------------------------------------------
INDEXING = {
    "getitem": OpRow(getitem, follow_rule(_getitem_out_dim, "a whole slice `:` on sharded dims"), method=False,
                     doc="x[index]: use the operator"),
    "narrow": OpRow(torch.narrow, follow_rule(off_dim(1, why="the slice's elements live on some ranks only"),
                                              "S(d) off the narrowed dim, R, Partial")),
    "index_select": OpRow(torch.index_select, _index_select_rule),
    "gather": OpRow(torch.gather, _gather_rule),
    "scatter": OpRow(torch.scatter, _scatter_rule),
    "topk": OpRow(torch.topk, follow_rule(off_dim(2, -1, _WHY, legal=_COMPARE_LEGAL), _COMPARE_LEGAL,
                                          partial_ok=False)),
    "sort": OpRow(torch.sort, follow_rule(off_dim(1, -1, _WHY, legal=_COMPARE_LEGAL), _COMPARE_LEGAL,
                                          partial_ok=False)),
    "kthvalue": OpRow(torch.kthvalue, follow_rule(_compared_away(2), _COMPARE_LEGAL, partial_ok=False),
                      doc="S(d) off the op's dim, R; no Partial"),
    "median": OpRow(torch.median, _every_element_or_along_dim,
                    doc="median(x, dim): S(d) off dim, R, no Partial; median(x): R only (every element)"),
    "nanmedian": OpRow(torch.nanmedian, _every_element_or_along_dim,
                       doc="nanmedian(x, dim): S(d) off dim, R, no Partial; nanmedian(x): R only (every element)"),
    "mode": OpRow(torch.mode, _ALONG_DIM_AT_1, doc="S(d) off the op's dim, R; no Partial"),
}
register_family("indexing", INDEXING)
