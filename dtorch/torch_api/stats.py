"""torch's statistics and flat-index functions, composed of dtorch's ops: `cov`, `corrcoef`,
`histc`, `take` and `diagflat`.

cov centres each variable (a row) by its (weighted) mean over the observations and contracts
the observations away, so with observations sharded the product is a P(sum) that one all-reduce
settles; histc adds one per element into its bin with scatter_add (a sharded input gives partial
counts, summed when read), never an (elements x bins) table. tests/test_composites.py checks each
against torch, gradients included.
"""
from __future__ import annotations

import torch

from ..dtensor.api import register_torch_spellings
from ..dtensor.factories import zeros
from ..dtensor.tensor import DTensor, call_op

__all__ = ["cov", "corrcoef", "histc", "take", "diagflat"]


def cov(input: DTensor, *, correction: int = 1, fweights=None, aweights=None) -> DTensor:
    """torch.cov: rows are variables, columns observations (a 1-D input is one variable)."""
    if input.ndim > 2:
        raise ValueError(f"cov(): expected input to have two or fewer dimensions but got an input with "
                         f"{input.ndim} dimensions")
    x = input if input.ndim == 2 else input.unsqueeze(0)
    if not x.dtype.is_floating_point:
        x = x.to(torch.get_default_dtype())
    weights = _weights(fweights, aweights, x)
    if weights is None:
        total = x.shape[1]
        centred = x - x.mean(1, keepdim=True)
        products = centred @ centred.T
        scale = max(total - correction, 0)
    else:
        total = weights.sum()
        centred = x - (x * weights).sum(1, keepdim=True) / total
        products = (centred * weights) @ centred.T
        scale = (total - correction * ((weights * aweights).sum() / total) if aweights is not None
                 else total - correction)
        scale = scale.clamp(min=0)
    result = products / scale
    return result.squeeze() if input.ndim < 2 else result


def _weights(fweights, aweights, x: DTensor):
    """fweights times aweights, in x's dtype (None when neither is given)."""
    weights = None
    for given in (fweights, aweights):
        if given is not None:
            given = given.to(x.dtype)
            weights = given if weights is None else weights * given
    return weights


def corrcoef(input: DTensor) -> DTensor:
    """torch.corrcoef: cov normalised by the standard deviations, clipped to [-1, 1]."""
    c = cov(input)
    if c.ndim == 0:
        return c / c
    spread = c.diagonal().sqrt()
    return (c / spread.unsqueeze(1) / spread.unsqueeze(0)).clamp(-1, 1)


def histc(input: DTensor, bins: int = 100, min: float = 0, max: float = 0, *, out=None) -> DTensor:
    """torch.histc: equal-width bins over [min, max] (the data's range when both are 0); elements
    outside are not counted, and max falls in the last bin."""
    if out is not None:
        raise TypeError("histc(..., out=...) is not supported by dtorch: use the returned tensor")
    if bins <= 0:
        raise RuntimeError("torch.histogramdd: expected bins to be > 0")   # torch's own words
    if min > max:
        raise RuntimeError("torch.histc: max must be larger than min")
    flat = input.reshape(-1)
    if min == max == 0:
        low, high = flat.min(), flat.max()
        same = high == low   # torch widens an empty range by 1 each way
        low, high = call_op("where", (same, low - 1, low), {}), call_op("where", (same, high + 1, high), {})
    else:
        low, high = (float(min), float(max)) if min != max else (float(min) - 1, float(max) + 1)
    inside = (flat >= low) & (flat <= high)
    index = ((flat - low) * bins / (high - low)).floor().long().clamp(0, bins - 1)
    counts = zeros(bins, dtype=input.dtype, device_mesh=input.device_mesh)
    return counts.scatter_add(0, index, inside.to(input.dtype))


def take(input: DTensor, index) -> DTensor:
    """torch.take: input as 1-D, read at `index` (negative counts from the end), shaped as index."""
    flat = input.reshape(-1)
    wrapped = (index + flat.shape[0]) % flat.shape[0]
    return flat.gather(0, wrapped.reshape(-1)).reshape(tuple(index.shape))


def diagflat(input: DTensor, offset: int = 0) -> DTensor:
    return call_op("diag", (input.reshape(-1), offset), {})


register_torch_spellings({"cov": cov, "corrcoef": corrcoef, "histc": histc, "take": take, "diagflat": diagflat})
