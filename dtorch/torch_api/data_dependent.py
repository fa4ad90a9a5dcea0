"""torch's ops whose result's shape depends on the values: `nonzero` (and `argwhere`,
`nonzero_static`), `masked_select`, `unique`, `unique_consecutive` and `bincount`. Each is a
documented blocking read.

No rank knows such a shape alone (the count of Trues, of distinct values, the largest value), and
the controller never waits on a worker to learn a shape, except here: each op makes one blocking
read, through DTensor._blocking_read (so dtorch.stats() counts it and set_sync_debug_mode("warn")
or "error" names the caller's line), of the least it needs, then the selection runs on the workers
where it can:

  nonzero, argwhere, nonzero_static
                     read the mask `x != 0` (one byte an element), upload the positions Replicate
  masked_select      read the mask, select with x's `index` op (x[mask], dtensor/indexing.py): the
                     result stays on x's mesh and gradients flow back to x
  unique(_consecutive) read the values (they are the result), upload the results: Replicate, and
                     `inverse` in x's placements (Partial ones as R) when it has x's shape
  bincount           read the minimum and the maximum (two numbers), then count with scatter_add on
                     the workers (no gradient to `weights`: torch has none)

x[mask] with a DTensor mask reads the mask the same way (dtorch/dtensor/indexing.py). Outside a
step, these reads are what the user asked for; inside one, `await x.fetch()` of the mask and a
torch mask index keep the controller's thread free. tests/test_data_dependent.py checks each
against torch on 1-, 4- and 2x2-worker meshes.
"""
from __future__ import annotations

import torch

from ..dtensor.api import register_torch_spellings
from ..spec.placements import Partial, Replicate, format_placements
from ..errors import UnsupportedOpError, user_site
from ..dtensor.factories import tensor as upload
from ..dtensor.factories import ones_like, zeros
from ..ops.tensor_meta import is_local_tensor
from ..dtensor.tensor import DTensor

__all__ = ["nonzero", "nonzero_static", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"]


def nonzero(input: DTensor, *, out=None, as_tuple: bool = False):
    """torch.nonzero / x.nonzero: a blocking read of `input != 0`; the positions, a long DTensor
    (n, ndim) Replicate on input's mesh (as_tuple: one 1-D DTensor per dim)."""
    _refuse_out(out, "torch.nonzero", input)
    read = _nonzero_mask(input)._blocking_read("torch.nonzero(x)")
    if as_tuple:
        return tuple([_replicated(positions, input) for positions in read.nonzero(as_tuple=True)])
    return _replicated(read.nonzero(), input)


def nonzero_static(input: DTensor, *, size: int, fill_value: int = -1) -> DTensor:
    """torch.nonzero_static: nonzero's read, cut or padded with fill_value to `size` rows."""
    read = _nonzero_mask(input)._blocking_read("torch.nonzero_static(x)")
    return _replicated(torch.nonzero_static(read, size=size, fill_value=fill_value), input)


def argwhere(input: DTensor) -> DTensor:
    """torch.argwhere: nonzero(input), a blocking read."""
    return nonzero(input)


def masked_select(input, mask, *, out=None) -> DTensor:
    """torch.masked_select: a blocking read of the mask, then input[mask] on the workers (the
    `index` op; input and mask broadcast together, as torch's)."""
    anchor = input if isinstance(input, DTensor) else mask
    _refuse_out(out, "torch.masked_select", anchor)
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    if not isinstance(input, DTensor):   # torch.masked_select(torch_x, dtensor_mask): a constant
        input = _replicated(torch.as_tensor(input), mask)
    shape = torch.broadcast_shapes(input.shape, mask.shape)
    read = mask._blocking_read("torch.masked_select(x, mask)") if isinstance(mask, DTensor) else mask
    if tuple(input.shape) != tuple(shape):
        input = input.expand(shape)
    return input[read.expand(shape)]


def unique(input: DTensor, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False,
           dim: int | None = None):
    """torch.unique / x.unique: a blocking read of the values; the results uploaded to input's mesh
    (no gradient: torch has none for unique either)."""
    read = input._blocking_read("torch.unique(x)")
    found = torch.unique(read, sorted=sorted, return_inverse=return_inverse, return_counts=return_counts, dim=dim)
    return _uploaded(found, input)


def unique_consecutive(input: DTensor, return_inverse: bool = False, return_counts: bool = False,
                       dim: int | None = None):
    """torch.unique_consecutive / x.unique_consecutive: as unique, a blocking read of the values."""
    read = input._blocking_read("torch.unique_consecutive(x)")
    found = torch.unique_consecutive(read, return_inverse=return_inverse, return_counts=return_counts, dim=dim)
    return _uploaded(found, input)


def bincount(input: DTensor, weights=None, minlength: int = 0) -> DTensor:
    """torch.bincount: a blocking read of two numbers (the minimum and the maximum), then the
    counting on the workers (scatter_add into zeros of length max + 1, or minlength). Like unique,
    no gradient: torch's bincount has none."""
    if input.ndim != 1 or input.dtype.is_floating_point or input.dtype.is_complex or input.dtype == torch.bool:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if weights is not None and tuple(weights.shape) != tuple(input.shape):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    dtype = torch.bincount(torch.zeros(1, dtype=torch.long), None if weights is None else
                           torch.ones(1, dtype=weights.dtype)).dtype
    length = int(minlength)
    if input.numel():
        bounds = torch.cat([bound.reshape(1).reduce_partials() for bound in (input.amin(), input.amax())])
        low, high = bounds._blocking_read("torch.bincount(x)").tolist()
        if low < 0:
            raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
        length = max(length, high + 1)
    counts = zeros(length, dtype=dtype, device_mesh=input.device_mesh)
    if not input.numel():
        return counts
    input = input.reduce_partials()
    # where the positions are split, each rank adds its own into zeros: a P(sum) (no communication)
    counts = counts.redistribute(placements=[Partial() if p.is_shard() else p for p in input.placements])
    if weights is None:
        values = ones_like(input, dtype=dtype)
    else:
        values = weights if isinstance(weights, DTensor) else _replicated(torch.as_tensor(weights), input)
    return counts.scatter_add(0, input.long(), values.detach().to(dtype))   # torch has no gradient either


# --- helpers -------------------------------------------------------------------------------------
def _nonzero_mask(input: DTensor) -> DTensor:
    """input != 0 on the workers (a Partial input reduced first: a sum's parts may be nonzero)."""
    return input if input.dtype == torch.bool else input.reduce_partials() != 0


def _replicated(value: torch.Tensor, like: DTensor) -> DTensor:
    mesh = like.device_mesh
    return upload(value, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)


def _uploaded(found, input: DTensor):
    """unique's torch result(s) on input's mesh: `inverse`, shaped like input, in its placements."""
    if is_local_tensor(found):
        return _replicated(found, input)
    results = [_replicated(found[0], input)]
    for result in found[1:]:
        if tuple(result.shape) == tuple(input.shape) and result.ndim:
            placements = [Replicate() if p.is_partial() else p for p in input.placements]
            results.append(upload(result, device_mesh=input.device_mesh, placements=placements))
        else:
            results.append(_replicated(result, input))
    return tuple(results)


def _refuse_out(out, op: str, tensor: DTensor) -> None:
    if out is not None:
        raise UnsupportedOpError(
            f"{op}(..., out=...) at {user_site()} on a {format_placements(tensor.placements)} DTensor over "
            f"{tensor.device_mesh}: dtorch results are new DTensors, never written into a given one; write "
            f"result = {op}(...) instead")


register_torch_spellings({"nonzero": nonzero, "nonzero_static": nonzero_static, "argwhere": argwhere,
                          "masked_select": masked_select, "unique": unique, "unique_consecutive": unique_consecutive,
                          "bincount": bincount})
