"""torch functions on order statistics, composed of dtorch's ops: `argsort`, `msort`, `quantile`
and `nanquantile`.

Each is the registry's sort plus gathers and a lerp, so placement rules (a sort along a sharded
dim gathers that dim first, as the sort op's rule says), autograd and dtorch.compile apply as to
those ops. `quantile` follows torch's definition step by step: ranks `q * (n - 1)` computed in the
input's dtype (so that floor and ceil pick torch's neighbours), a row holding a NaN gives NaN,
and nanquantile ranks by each row's count of numbers. tests/test_composites.py checks each
against torch, gradients included.
"""
from __future__ import annotations

import torch

from ..dtensor.api import register_torch_spellings
from ..spec.placements import Replicate
from ..dtensor.factories import full, tensor as upload
from ..ops.tensor_meta import is_local_tensor
from ..dtensor.tensor import DTensor, call_op

__all__ = ["argsort", "msort", "quantile", "nanquantile"]

INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")


def argsort(input: DTensor, dim: int = -1, descending: bool = False, stable: bool = False) -> DTensor:
    return call_op("sort", (input,), {"dim": dim, "descending": descending, "stable": stable})[1]


def msort(input: DTensor) -> DTensor:
    return call_op("sort", (input,), {"dim": 0})[0]


def quantile(input: DTensor, q, dim: int | None = None, keepdim: bool = False, *, interpolation: str = "linear",
             out=None) -> DTensor:
    return _quantile("quantile", input, q, dim, keepdim, interpolation, out, ignore_nan=False)


def nanquantile(input: DTensor, q, dim: int | None = None, keepdim: bool = False, *, interpolation: str = "linear",
                out=None) -> DTensor:
    return _quantile("nanquantile", input, q, dim, keepdim, interpolation, out, ignore_nan=True)


def _quantile(name, input, q, dim, keepdim, interpolation, out, ignore_nan: bool) -> DTensor:
    _check(name, input, q, interpolation, out)
    rows = input.flatten() if dim is None else input.movedim(dim, -1)
    ordered = call_op("sort", (rows,), {"dim": -1})[0]            # NaNs last, as torch sorts them
    ranks = _ranks(ordered, _q_tensor(q, input), ignore_nan)      # (..., 1), or (..., len(q))
    if interpolation == "lower":
        ranks = ranks.floor()
    elif interpolation == "higher":
        ranks = ranks.ceil()
    elif interpolation == "nearest":
        ranks = ranks.round()                                     # half to even, as torch
    below = ranks.long()
    result = ordered.gather(-1, below)
    if interpolation in ("linear", "midpoint"):
        weights = ranks - below if interpolation == "linear" else 0.5
        result = result.lerp(ordered.gather(-1, ranks.ceil().long()), weights)
    return _arrange(result, input, q, dim, keepdim)


def _check(name: str, input: DTensor, q, interpolation: str, out) -> None:
    if out is not None:
        raise TypeError(f"{name}(..., out=...) is not supported by dtorch: use the returned tensor")
    if input.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(f"{name}() input tensor must be either float or double dtype")
    if interpolation not in INTERPOLATIONS:
        raise RuntimeError(f"{name}() interpolation must be one of linear, lower, higher, midpoint or nearest. "
                           f"Got {interpolation}")
    if isinstance(q, (torch.Tensor, DTensor)) and q.ndim > 1:
        raise RuntimeError(f"{name}() q must be a scalar or 1D tensor")
    if is_local_tensor(q) and not bool(((q >= 0) & (q <= 1)).all()):   # a DTensor q is not read
        raise RuntimeError(f"{name}() q values must be in the range [0, 1]")
    if not isinstance(q, (torch.Tensor, DTensor)) and not 0 <= q <= 1:
        raise RuntimeError(f"{name}() q must be in the range [0, 1] but got {q}")


def _q_tensor(q, input: DTensor) -> DTensor:
    """q in the input's dtype, replicated on its mesh: made there for a number, uploaded for a
    torch tensor (pass a DTensor to upload it once)."""
    mesh, replicated = input.device_mesh, [Replicate()] * input.device_mesh.ndim
    if isinstance(q, DTensor):
        return q.to(input.dtype).redistribute(mesh, replicated)
    if isinstance(q, torch.Tensor):
        return upload(q.to(input.dtype), device_mesh=mesh, placements=replicated)
    return full((), float(q), dtype=input.dtype, device_mesh=mesh, placements=replicated)


def _ranks(ordered: DTensor, q: DTensor, ignore_nan: bool) -> DTensor:
    """Each row's fractional rank of each q, torch's way: q * (count of numbers - 1), at least 0,
    for nanquantile; q * (n - 1), or n - 1 (a NaN) where the row holds a NaN, for quantile.
    Shaped (..., 1) or (..., len(q)): the rows' leading dims come from the NaN test."""
    nans = ordered.isnan()
    if ignore_nan:
        counts = (~nans).sum(-1, keepdim=True)
        ranks = q * (counts - 1)
        return ranks.clamp(min=0)
    last = ordered.shape[-1] - 1
    return call_op("where", (nans.any(-1, keepdim=True), float(last), q * last), {})


def _arrange(result: DTensor, input: DTensor, q, dim, keepdim: bool) -> DTensor:
    """(..., len(q)) -> torch's output: the q dim first (only for a 1-D q), then the kept dims."""
    scalar_q = not isinstance(q, (torch.Tensor, DTensor)) or q.ndim == 0
    result = result.squeeze(-1) if scalar_q else result.movedim(-1, 0)
    if keepdim:
        lead = 0 if scalar_q else 1
        if dim is None:
            result = result.reshape(tuple(result.shape[:lead]) + (1,) * input.ndim)
        else:
            result = result.unsqueeze(lead + dim % input.ndim)
    return result


register_torch_spellings({"argsort": argsort, "msort": msort, "quantile": quantile, "nanquantile": nanquantile})
