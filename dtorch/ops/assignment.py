"""PURE: item assignment as an op. `setitem(x, index, value)` is the out-of-place form of
`x[index] = value` (a new tensor; dtorch/dtensor/inplace.py rebinds x to it). The index is the canonical
basic index of `canonical_index` (ints, slices, None); the value a scalar or a tensor that
broadcasts to the indexed region.

  target S(d), index `:` on d      value S(e) on the region dim that d becomes (R sliced to match),
                                   or a value broadcast on that dim and R: purely local
                                   (a KV-cache write `cache[:, :, pos] = k` with cache and k S(heads))
  target S(d), other index on d    value R: each rank writes the part of the region inside its
                                   shard (the kernel learns its block from a ShardRegion)
  target R                         value R; or a P(max|min|avg) value -> that Partial (the rest of
                                   the target repeats on every rank, which those reductions keep)
  target Partial                   value the same Partial (each rank writes its share), or R / a
                                   scalar when the reduction keeps a repeated value (max, min, avg)
"""
from __future__ import annotations


from ..spec.placements import Partial, Shard, ShardRegion
from .indexing import WHOLE
from .registry import OpRow, kernel, register_family
from .rules import Call, Decision, R, RuleRejected
from .tensor_meta import is_local_tensor

__all__ = ["ASSIGNMENT", "setitem", "torch_index", "region_dims"]

_LEGAL = ("target S(d) with `:` on d and the value S(its region dim) or broadcast and R; target S(d) with "
          "any other index on d and the value R; all R; target and value the same Partial; target R with a "
          "P(max|min|avg) value")


def torch_index(index) -> tuple:
    """A canonical index (tuples or wire lists for slices) as torch's own."""
    return tuple([item if item is None or isinstance(item, int) else slice(*item) for item in index])


def setitem(input, index, value):
    """The reference and the local kernel when every rank writes its whole block."""
    out = input.clone()
    out[torch_index(index)] = value
    return out


def region_dims(index) -> tuple[dict, int]:
    """{input dim: region dim} for the dims the index keeps, and the region's ndim."""
    kept, in_dim, out_dim = {}, 0, 0
    for item in index:
        if item is None:
            out_dim += 1
            continue
        if not isinstance(item, int):
            kept[in_dim] = out_dim
            out_dim += 1
        in_dim += 1
    return kept, out_dim


def _is_whole(item) -> bool:
    return item is not None and not isinstance(item, int) and tuple(item) == WHOLE


def _item_on(index, dim: int):
    in_dim = 0
    for item in index:
        if item is not None:
            if in_dim == dim:
                return item
            in_dim += 1
    return WHOLE   # canonical_index fills every dim; kept for hand-built calls


def _setitem_rule(call: Call, placements) -> Decision:
    target, value = placements[0], (placements[1] if len(placements) > 1 else None)
    if isinstance(target, Partial):
        if value == target or (target.reduce_op != "sum" and (value is None or value.is_replicate())):
            return Decision(placements, (target,))
        raise RuleRejected(f"a {target!r} target takes a value of the same Partial (or R / a scalar for "
                           "max, min and avg): any other value would count once per rank", _LEGAL)
    if isinstance(value, Partial):
        if target.is_replicate() and value.reduce_op != "sum":   # max/min/avg keep the repeated rest
            return Decision(placements, (value,))
        raise RuleRejected(f"a {value!r} value needs a target of the same Partial (or R for max, min, avg)", _LEGAL)
    if target.is_replicate():
        if value is None or value.is_replicate():
            return Decision(placements, (R,))
        raise RuleRejected("a sharded value cannot be written into a Replicate target", _LEGAL)
    return _sharded_target(call, placements, target.dim, value)


def _sharded_target(call: Call, placements, dim: int, value) -> Decision:
    index = call.param(1, "index")
    kept, region_ndim = region_dims(index)
    if value is None:
        return Decision(placements, (placements[0],))
    value_spec = call.inputs[1]
    value_dim = kept[dim] - (region_ndim - len(value_spec.shape)) if dim in kept else -1
    aligned = (_is_whole(_item_on(index, dim)) and value_dim >= 0
               and value_spec.shape[value_dim] == call.inputs[0].shape[dim] != 1)
    if aligned and (value.is_replicate() or value == Shard(value_dim)):
        return Decision((placements[0], Shard(value_dim)), (placements[0],))
    if not aligned and value.is_replicate():
        return Decision(placements, (placements[0],))
    raise RuleRejected(f"the value's {value!r} does not line up with the target's S({dim}) "
                       f"(the value must be {'S(%d)' % value_dim if aligned else 'R'} there)", _LEGAL)


def _setitem_local(call: Call, required):
    """Ranks write only inside their block where a sharded dim is indexed by other than `:`."""
    index = call.param(1, "index")
    if any(isinstance(p, Shard) and not _is_whole(_item_on(index, p.dim)) for p in required[0]):
        return "setitem_region", {"region": ShardRegion(call.inputs[0].shape, required[0])}
    return "setitem", {}


@kernel("setitem_region")
def setitem_region(input, index, value, *, region):
    """x[index] = value restricted to this rank's block: `region` is its (offset, shape) in the
    global target; a value that is whole (R) on an indexed sharded dim is narrowed to the part
    of the region inside the block."""
    (offset, size), out = region, input.clone()
    kept, region_ndim = region_dims(index)
    local, narrows, in_dim = [], {}, 0
    for item in index:
        if item is None:
            local.append(None)
            continue
        start, count = offset[in_dim], size[in_dim]
        if isinstance(item, int):
            if not start <= item < start + count:
                return out
            local.append(item - start)
        elif _is_whole(item):
            local.append(slice(None))
        else:
            first, stop, step = item
            k0 = max(0, -(-(start - first) // step))
            k1 = min(len(range(first, stop, step)), -(-(start + count - first) // step))
            if k1 <= k0:
                return out
            local.append(slice(first + k0 * step - start, first + (k1 - 1) * step - start + 1, step))
            narrows[kept[in_dim]] = (k0, k1 - k0)
        in_dim += 1
    if is_local_tensor(value):
        for region_dim, (k0, length) in narrows.items():
            value_dim = region_dim - (region_ndim - value.ndim)
            if value_dim >= 0 and value.shape[value_dim] != 1:
                value = value.narrow(value_dim, k0, length)
    out[tuple(local)] = value
    return out


ASSIGNMENT = {
    "setitem": OpRow(setitem, _setitem_rule, _setitem_local, method=False,
                     doc="x[index] = value: use the operator (dtorch/dtensor/inplace.py rebinds x)"),
}
register_family("indexing", ASSIGNMENT)
