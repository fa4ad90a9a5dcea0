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
  writes         index_add, index_copy, index_fill, scatter_add, scatter_reduce, select_scatter,
                 slice_scatter: the input and the written values sharded alike off dim (R sliced to
                 match; a 1-D index or a 0-d value stays R); a Partial only where each rank writing
                 its share is right, by how the written values meet the old ones (`_WRITE_LAWS`):
                 a copy passes the same Partial on both (beside an R, any but P(sum), which would
                 count the R once per rank), an addition P(sum|avg) (beside an R, P(avg)), amax
                 P(max) and amin P(min) (beside an R too), a product none; positions stay R
  topk, sort     S(d) off the op's dim; no Partial (they compare values)
  kthvalue, median, nanmedian, mode
                 the same along their dim (gone from the result unless keepdim); median(x) and
                 nanmedian(x) without a dim compare every element: Replicate only (outside strict
                 mode dtorch gathers a sharded input first)
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..spec.placements import Partial, Shard
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
    items = tuple([_check_item(item) for item in (index if type(index) is tuple else (index,))])
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
    return tuple([None if item is None else _canonical_item(item, *next(dims)) for item in items])


class AdvancedIndex(Exception):
    """Raised by canonical_index for an index with tensors, lists or bools: the caller takes the
    advanced path (dtorch/dtensor/indexing.py, ops/advanced_indexing.py) instead of getitem's."""


def _check_item(item):
    """The item itself, or an int for int-like ones (numpy ints); AdvancedIndex for tensors (a
    DTensor has `_meta`), lists, tuples (inside an index tuple torch reads one as a list), bools
    and arrays."""
    if item is None or item is Ellipsis or isinstance(item, slice) or type(item) is int:
        return item
    if isinstance(item, (bool, list, tuple, torch.Tensor)) or hasattr(item, "_meta") or getattr(item, "ndim", 0):
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
    return input[tuple([item if item is None or isinstance(item, int) else slice(*item) for item in index])]


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


# --- writes: values put at positions of a copy of the input -------------------------------------
class WriteLaw(NamedTuple):
    """How the written values meet what is there decides which Partial passes (on one mesh dim):
    the reductions that commute with the write when input and values hold the same Partial, when
    only the input does (the values R: a sum would count them once per rank) and when only the
    values do. `split`: the Partial the result is when positions and values are split alike along
    the write's dim, each rank combining its share into its copy of the input (which it must hold
    as that Partial, or R for a max or min: seeing the input again changes neither)."""
    both: frozenset
    input_only: frozenset
    values_only: frozenset
    split: str | None = None


_ALL_REDUCTIONS = frozenset({"sum", "avg", "max", "min"})
_SHIFTS = frozenset({"avg", "max", "min"})    # keep a value every rank holds alike
_WRITE_LAWS = {
    "copy": WriteLaw(_ALL_REDUCTIONS, _SHIFTS, _SHIFTS),
    # positions may repeat, so values add up per rank: a max of sums is not a sum of maxes
    "add": WriteLaw(frozenset({"sum", "avg"}), _SHIFTS, frozenset({"avg"}), split="sum"),
    "add without self": WriteLaw(frozenset({"sum", "avg"}), _SHIFTS, frozenset({"avg"})),
    "mean": WriteLaw(frozenset({"sum", "avg"}), _SHIFTS, frozenset({"avg"})),
    # max(x, v) distributes over a min of x's contributions too
    "max": WriteLaw(frozenset({"max"}), frozenset({"max", "min"}), frozenset({"max"}), split="max"),
    "min": WriteLaw(frozenset({"min"}), frozenset({"max", "min"}), frozenset({"min"}), split="min"),
    # without self, written places take the values alone: the input's other places any shift
    "max without self": WriteLaw(frozenset({"max"}), _SHIFTS, frozenset({"max"})),
    "min without self": WriteLaw(frozenset({"min"}), _SHIFTS, frozenset({"min"})),
    "prod": WriteLaw(frozenset(), frozenset({"sum", "avg"}), frozenset()),   # linear in the input alone
    "prod without self": WriteLaw(frozenset(), _SHIFTS, frozenset()),
}
_WRITE_LEGAL = ("input and values S(d) off dim (R sliced to match, sizes on d equal; a 1-D index or 0-d value R); "
                "all R; a Partial the write commutes with (see the op's row), positions R")


class _Write(NamedTuple):
    """One write op: its dim's position, the inputs that hold positions, the law by which values
    meet the input, and the values' dims in the input's (target's) dims."""
    dim_at: int
    positions: tuple                     # input indices of index tensors
    law: Callable[[Call], str]
    dims_in_target: Callable | None = None   # (call, input index, dim along) -> its dims as target dims
    partials: str = ""                   # the Partial forms, in words (docs/reference/ops.md)


def _same_dims(call: Call, index: int, along: int):
    """An input shaped like the target (scatter's index and src, index_add's source): dims as is;
    a 1-D index along `along` (index_add's) or a 0-d value: no dim lines up."""
    ndim = len(call.inputs[index].shape)
    return tuple(range(ndim)) if ndim == len(call.inputs[0].shape) else None


def _without_dim(call: Call, index: int, along: int):
    """select_scatter's src: the target's dims less `along`."""
    return tuple([d for d in range(len(call.inputs[0].shape)) if d != along])


def _write_partial(call: Call, placements, write: _Write):
    """The Partial a write yields (None when it yields none: no input is Partial or split)."""
    target, law = placements[0], _WRITE_LAWS[write.law(call)]
    if law.split and _split_alike(call, placements, write):
        split = Partial(law.split)
        if target == split or (target.is_replicate() and law.split in ("max", "min")):
            return split
    if not any(isinstance(p, Partial) for p in placements):
        return None
    given = ", ".join(map(repr, placements))
    if any(not placements[i].is_replicate() for i in write.positions):
        raise RuleRejected(f"{call.op} takes positions R beside a Partial, given ({given})", _WRITE_LEGAL)
    values = [p for i, p in enumerate(placements) if i and i not in write.positions]
    value = values[0] if values else R    # a number written is the same on every rank
    if isinstance(target, Partial) and value == target:
        allowed, partial = law.both, target
    elif isinstance(target, Partial) and value.is_replicate():
        allowed, partial = law.input_only, target
    elif target.is_replicate() and isinstance(value, Partial):
        allowed, partial = law.values_only, value
    else:
        allowed, partial = frozenset(), None
    if partial is None or partial.reduce_op not in allowed:
        raise RuleRejected(f"{call.op} ({write.law(call)} of the values) does not commute with the reductions "
                           f"of ({given})", _WRITE_LEGAL)
    return partial


def _split_alike(call: Call, placements, write: _Write) -> bool:
    """Positions and values sharded so that each rank holds matching pieces of both: an index and
    src shaped alike on the same dim, or index_add's 1-D index S(0) with its source S(dim)."""
    (index,) = write.positions
    rest = [i for i in range(1, len(placements)) if i != index]
    if len(rest) != 1 or not all(isinstance(placements[i], Shard) for i in (index, rest[0])):
        return False
    values, index_spec, values_spec = placements[rest[0]], call.inputs[index], call.inputs[rest[0]]
    along = normalize_dim(call.param(write.dim_at, "dim"), len(call.inputs[0].shape))
    if values.dim != along:   # off it, a rank's local coordinates would address the wrong rows
        return False
    if len(index_spec.shape) == 1:
        return True
    return placements[index] == values and index_spec.shape[along] == values_spec.shape[along]


def _write_rule(write: _Write):
    def rule(call: Call, placements) -> Decision:
        partial = _write_partial(call, placements, write)
        if partial is not None:
            return Decision(placements, (partial,))
        along = normalize_dim(call.param(write.dim_at, "dim", 0), len(call.inputs[0].shape))
        lined_up = [(write.dims_in_target or _same_dims)(call, i, along) if i else tuple(range(len(spec.shape)))
                    for i, spec in enumerate(call.inputs)]
        return _written_shards(call, placements, along, lined_up)
    return rule


def _written_shards(call: Call, placements, along: int, lined_up) -> Decision:
    targets = set()
    for p, dims in zip(placements, lined_up):
        if isinstance(p, Shard):
            if dims is None:
                raise RuleRejected(f"{call.op}'s positions or value are {p!r}: each rank needs all of them",
                                   _WRITE_LEGAL)
            targets.add(dims[p.dim])
    if not targets:
        return Decision(placements, (R,))
    if len(targets) > 1:
        raise RuleRejected(f"{call.op}'s inputs are sharded on different dims {sorted(targets)}", _WRITE_LEGAL)
    d = targets.pop()
    if d == along:
        raise RuleRejected(f"{call.op} along sharded dim {d} writes positions other ranks hold; "
                           f"{unshard_fix(call, Shard(d))}", _WRITE_LEGAL)
    size = call.inputs[0].shape[d]
    required = []
    for spec, p, dims in zip(call.inputs, placements, lined_up):
        if dims is None:
            required.append(p)
            continue
        own = dims.index(d)
        if spec.shape[own] != size:
            raise RuleRejected(f"{call.op}'s tensors differ in size on sharded dim {d} ({spec.shape[own]} and "
                               f"{size}), so their shards would not line up", _WRITE_LEGAL)
        required.append(Shard(own))
    return Decision(tuple(required), (Shard(d),))


def _law(name: str):
    return lambda call: name


def _scatter_reduce_law(call: Call) -> str:
    reduce, include_self = call.param(4, "reduce"), call.param(5, "include_self", True)
    law = {"sum": "add", "mean": "mean", "amax": "max", "amin": "min", "prod": "prod"}[reduce]
    return law if include_self or law == "mean" else f"{law} without self"


_INDEX_WRITE: dict[str, Any] = dict(dim_at=1, positions=(1,))
_COPY = "input and values the same Partial; P(avg|max|min) on either beside R"
_ADD = ("input and source P(sum|avg); input P(avg|max|min) or source P(avg) beside R; input P(sum) with "
        "index and source split alike")
WRITES = {
    "index_add": _Write(law=_law("add"), partials=_ADD, **_INDEX_WRITE),
    "index_copy": _Write(law=_law("copy"), partials=_COPY, **_INDEX_WRITE),
    "index_fill": _Write(law=_law("copy"), partials=_COPY + " (a number value is R)", **_INDEX_WRITE),
    "scatter_add": _Write(law=_law("add"), partials=_ADD, **_INDEX_WRITE),
    "scatter_reduce": _Write(law=_scatter_reduce_law, partials="by reduce, as `_WRITE_LAWS` in ops/indexing.py: "
                             "sum as scatter_add, mean alike but never split, amax P(max) (input also P(min)), "
                             "amin the mirror, prod a Partial input beside R values only", **_INDEX_WRITE),
    "select_scatter": _Write(dim_at=2, positions=(), law=_law("copy"), dims_in_target=_without_dim, partials=_COPY),
    "slice_scatter": _Write(dim_at=2, positions=(), law=_law("copy"), partials=_COPY),
}


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
    **{name: OpRow(getattr(torch, name), _write_rule(write), doc=f"shards: {_WRITE_LEGAL}; Partial: {write.partials}")
       for name, write in WRITES.items()},
}
register_family("indexing", INDEXING)
