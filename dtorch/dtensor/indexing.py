"""x[t], x[t] = v, index_put(_) and masked_scatter(_) on DTensors: the user's index as the canonical
one of ops/advanced_indexing.py (its rules live there).

What the controller knows it resolves itself: a torch bool mask or a list of bools becomes its
nonzero positions (as torch does), a 0-d torch index an int, and torch index tensors, lists and
tuples of ints (torch reads a tuple inside an index as a list) are checked against the dims and
uploaded (small) as Replicate DTensors. x[mask] with a DTensor bool mask has a shape that depends on
the mask's values: it is a blocking read of the mask (through DTensor._blocking_read, so
set_sync_debug_mode names it), whose positions are then uploaded and selected on the workers by the
`index` op, so the result stays on x's mesh and gradients flow back to x. x[mask] = v keeps x's
shape and reads nothing: a where (a scalar or a value broadcast over the selected rows) or a
masked_scatter (one row of v per True).
"""
from __future__ import annotations

import torch

from ..spec.placements import Replicate
from ..errors import UnsupportedOpError, user_site
from .factories import tensor as upload
from .inplace import assign
from ..ops.indexing import _canonical_item
from ..ops.tensor_meta import is_local_tensor
from . import api
from .tensor import DTensor, call_op

__all__ = ["getitem", "setitem", "index_put", "canonical_advanced_index"]


def getitem(x: DTensor, index) -> DTensor:
    return call_op("index", (x, canonical_advanced_index(x, index, "x[index]")), {})


def setitem(x: DTensor, index, value) -> None:
    mask = _dtensor_mask(index)
    if is_local_tensor(value):   # an explicit upload: the only way local data enters
        value = _replicated(x, value)
    if mask is not None:
        return assign(x, _masked_write(x, mask, value), "x[mask] = value")
    indices = canonical_advanced_index(x, index, "x[index] = value")
    assign(x, call_op("index_put", (x, indices, value), {}), "x[index] = value")


def index_put(x: DTensor, indices, values, accumulate: bool = False) -> DTensor:
    """torch.Tensor.index_put: `indices` a tuple of index tensors (torch or DTensor, long or bool)."""
    if not isinstance(indices, (tuple, list)):
        raise TypeError(f"index_put takes a tuple of index tensors, not {type(indices).__name__}")
    if is_local_tensor(values):
        values = _replicated(x, values)
    canonical = canonical_advanced_index(x, tuple(indices), "index_put")
    return call_op("index_put", (x, canonical, values), {"accumulate": accumulate} if accumulate else {})


def _index_put_(x: DTensor, indices, values, accumulate: bool = False) -> DTensor:
    return assign(x, index_put(x, indices, values, accumulate), "x.index_put_")


# --- the user's index -> canonical --------------------------------------------------------------------
def canonical_advanced_index(x: DTensor, index, op: str) -> tuple:
    items = _sequence(index)
    items = [_resolved(x, item, op) for item in items]
    items = _fill_ellipsis(items, x.ndim)
    out, dim = [], 0
    for item in items:
        if item is None or type(item) is bool:
            out.append(item)
        elif is_local_tensor(item) and item.dtype == torch.bool:
            out += _mask_positions(x, item, dim)
            dim += item.ndim
        elif isinstance(item, (torch.Tensor, DTensor)):
            out.append(_index_tensor(x, item, dim, op))
            dim += 1
        else:
            out.append(_canonical_item(item, dim, x.shape[dim]))
            dim += 1
    return tuple(out)


def _sequence(index) -> tuple:
    """torch's reading of an index: a tuple is one item per dim, and so is a short list holding
    sequences, slices, None, Ellipsis or tensors (torch's legacy rule); anything else is one item."""
    if type(index) is tuple:
        return index
    if type(index) is list and len(index) < 32 and any(
            isinstance(i, (list, tuple, slice, torch.Tensor, DTensor)) or i is None or i is Ellipsis for i in index):
        return tuple(index)
    return (index,)


def _resolved(x: DTensor, item, op: str):
    """Lists, tuples, arrays and 0-d tensors as torch tensors, Python ints or bools; a DTensor as is,
    but for a bool mask, which is read (one blocking read) and then resolved as a torch mask."""
    if isinstance(item, DTensor) and item.dtype == torch.bool:   # its count of Trues is the result's shape
        item = item._blocking_read(_MASK_READS.get(op, f"{op} with a DTensor bool mask"))
    if isinstance(item, DTensor):
        if item.dtype.is_floating_point or item.dtype.is_complex:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return item
    if isinstance(item, (list, tuple)) or type(item).__module__ == "numpy":   # x[(0, 1), (2, 3)]: as lists
        item = torch.as_tensor(item)
        if item.numel() == 0 and item.dtype.is_floating_point:   # x[[]] indexes with an empty long tensor
            item = item.long()
    if is_local_tensor(item):
        if item.dtype.is_floating_point or item.dtype.is_complex:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        if item.dtype == torch.uint8:   # torch's deprecated byte masks
            item = item.bool()
        if item.ndim == 0:
            return bool(item) if item.dtype == torch.bool else int(item)
    return item


_MASK_READS = {"x[index]": "x[mask]", "x[index] = value": "x[mask] = value"}   # the read's name


def _fill_ellipsis(items: list, ndim: int) -> list:
    consumed = sum(1 if not is_local_tensor(i) or i.dtype != torch.bool else i.ndim
                   for i in items if i is not None and i is not Ellipsis and type(i) is not bool)
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if consumed > ndim:
        raise IndexError(f"too many indices for a DTensor of dimension {ndim}")
    fill = [slice(None)] * (ndim - consumed)
    if any(i is Ellipsis for i in items):
        at = next(n for n, i in enumerate(items) if i is Ellipsis)
        return items[:at] + fill + items[at + 1:]
    return items


def _mask_positions(x: DTensor, mask: torch.Tensor, dim: int) -> list:
    """A bool mask over dims dim.. as torch reads it: one index tensor of its nonzero positions per dim."""
    covered = tuple(x.shape[dim:dim + mask.ndim])
    if tuple(mask.shape) != covered:
        raise IndexError(f"The shape of the mask {list(mask.shape)} at index {dim} does not match the shape "
                         f"of the indexed tensor {list(x.shape)} at index {dim}")
    return [_replicated(x, positions) for positions in mask.nonzero(as_tuple=True)]


def _index_tensor(x: DTensor, item, dim: int, op: str):
    if isinstance(item, DTensor):
        return item
    size = x.shape[dim]
    bad = (item < -size) | (item >= size)
    if bool(bad.any()):
        raise IndexError(f"index {int(item[bad][0])} is out of bounds for dimension {dim} with size {size}")
    return _replicated(x, item.long())


def _replicated(x: DTensor, value: torch.Tensor) -> DTensor:
    return upload(value, device_mesh=x.device_mesh, placements=[Replicate()] * x.device_mesh.ndim)


# --- x[mask] = value with a DTensor mask: x keeps its shape ----------------------------------------------
def _dtensor_mask(index):
    item = index[0] if type(index) is tuple and len(index) == 1 else index
    return item if isinstance(item, DTensor) and item.dtype == torch.bool else None


def _masked_write(x: DTensor, mask: DTensor, value) -> DTensor:
    """x[mask] = value: the mask covers x's leading dims; each True selects a row of x's other dims."""
    rows = tuple(x.shape[mask.ndim:])
    if tuple(mask.shape) != tuple(x.shape[:mask.ndim]):
        raise IndexError(f"The shape of the mask {list(mask.shape)} at index 0 does not match the shape of the "
                         f"indexed tensor {list(x.shape)} at index 0")
    spread = mask.reshape(tuple(mask.shape) + (1,) * len(rows)) if rows else mask
    if not isinstance(value, DTensor):
        return call_op("masked_fill", (x, spread, value), {})
    shape = tuple(value.shape)
    if len(shape) > len(rows) and shape[0] == 1 and len(shape) == len(rows) + 1:
        value, shape = value.reshape(shape[1:]), shape[1:]
    if len(shape) <= len(rows):    # the same row for every True
        return call_op("where", (spread, value, x), {})
    if shape[1:] == rows:          # one row of value per True, in order
        return call_op("masked_scatter", (x, spread, value), {})
    raise UnsupportedOpError(f"x[mask] = value at {user_site()}: a value of shape {list(value.shape)} does not fit "
                             f"rows of shape {list(rows)}; use x.masked_scatter_(mask, source)")


api.register_methods({
    "_advanced_getitem": getitem,    # dtensor/tensor.py's seam for x[t]
    "_advanced_setitem": setitem,    # dtensor/inplace.py's seam for x[t] = v
    "index_put": index_put,
    "index_put_": _index_put_,       # masked_scatter and masked_scatter_ come from the registry row
})
