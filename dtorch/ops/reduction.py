"""PURE: reductions over dims. One table: op -> (torch function, the Partial a sharded reduction
yields, the Partial inputs it accepts).

Reducing over a sharded dim communicates nothing: each rank reduces its shard and the result is
Partial (sum -> P(sum), amax -> P(max)); the reduction finishes when the user reads or
redistributes. Ops with no such partial form (prod, var, ...) need Replicate on reduced dims.
"""
from __future__ import annotations

import math

import torch

from ..distributed_spec import Partial, Shard
from .registry import OpSpec, kernel, register
from .rules import Call, Decision, R, RuleRejected

__all__ = ["REDUCTIONS", "reduced_dims"]


def reduced_dims(call: Call) -> tuple[int, ...]:
    ndim = len(call.inputs[0].shape)
    dim = call.param(1, "dim", None)
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(d % max(ndim, 1) for d in dims)) if dims else tuple(range(ndim))


def reduction_rule(partial_result: str | None, partial_inputs: frozenset):
    legal = (f"S(d) on a kept dim, R, S(d) on a reduced dim (gives P({partial_result}))"
             if partial_result else "S(d) on a kept dim, R") + \
            (f", {' or '.join(f'P({op})' for op in sorted(partial_inputs))}" if partial_inputs else "")

    def rule(call: Call, placements) -> Decision:
        (p,) = placements
        if isinstance(p, Partial):
            if p.reduce_op not in partial_inputs:
                raise RuleRejected(f"{call.op} does not commute with the reduction of a {p!r} input", legal)
            return Decision(placements, (p,))
        if not isinstance(p, Shard):
            return Decision(placements, (R,))
        dims = reduced_dims(call)
        if p.dim in dims:
            if partial_result is None:
                raise RuleRejected(f"{call.op} over sharded dim {p.dim} has no exact partial form", legal)
            return Decision(placements, (Partial(partial_result),))
        keepdim = call.param(2, "keepdim", False)
        out_dim = p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)
        return Decision(placements, (Shard(out_dim),))
    return rule


def _sharded_reduced_dims(call: Call, placements_nd) -> bool:
    dims = reduced_dims(call)
    return any(isinstance(p, Shard) and p.dim in dims for p in placements_nd[0])


def _mean_local(call: Call, placements_nd):
    if not _sharded_reduced_dims(call, placements_nd):
        return "mean", {}
    count = math.prod(call.inputs[0].shape[d] for d in reduced_dims(call))
    return "mean_as_partial_sum", {"count": count}


@kernel("mean_as_partial_sum")
def mean_as_partial_sum(input, dim=None, keepdim=False, *, dtype=None, count):
    if dim is None:
        return torch.sum(input, dtype=dtype) / count
    return torch.sum(input, dim, keepdim, dtype=dtype) / count


def _identity_fill(torch_fn, identity):
    """amax/amin of an empty local shard (uneven tails) is the reduction's identity, not an error."""
    def local(input, dim=None, keepdim=False):
        if input.numel() == 0:
            shape = torch_fn(torch.empty(input.shape, dtype=input.dtype, device="meta"),
                             dim if dim is not None else (), keepdim).shape
            return torch.full(shape, identity(input.dtype), dtype=input.dtype, device=input.device)
        return torch_fn(input, dim if dim is not None else (), keepdim)
    return local


def _lowest(dtype):
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _highest(dtype):
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


KERNELS_SAFE = {"amax": _identity_fill(torch.amax, _lowest), "amin": _identity_fill(torch.amin, _highest)}
for _name, _fn in KERNELS_SAFE.items():
    kernel(_name + "_safe")(_fn)

# name: (torch function, Partial of a sharded reduction, Partial inputs accepted, local hook)
REDUCTIONS = {
    "sum": (torch.sum, "sum", frozenset({"sum", "avg"}), None),
    "mean": (torch.mean, "sum", frozenset({"sum", "avg"}), _mean_local),
    "amax": (torch.amax, "max", frozenset({"max"}), lambda call, p: ("amax_safe", {})),
    "amin": (torch.amin, "min", frozenset({"min"}), lambda call, p: ("amin_safe", {})),
    "prod": (torch.prod, None, frozenset(), None),
}

for _name, (_fn, _result, _inputs, _local) in REDUCTIONS.items():
    register(OpSpec(_name, _fn, reduction_rule(_result, _inputs), "reduction", local=_local))
