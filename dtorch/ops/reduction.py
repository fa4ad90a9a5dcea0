"""PURE: reductions over dims and ops along one dim. Two tables.

REDUCTIONS: op -> (torch function, the Partial a reduction over a sharded dim yields, the
Partial inputs it passes through, where its `dim` argument sits, local hook).
Reducing over a sharded dim communicates nothing: each rank reduces its shard and the result is
Partial (sum -> P(sum), amax -> P(max), any -> P(max) on bool, which Gloo reduces natively); the
reduction finishes when the user reads or redistributes. Ops with no exact partial form (prod,
var, logsumexp, argmax, max with indices) need Replicate on reduced dims.

ALONG_DIM: op -> (torch function, Partial inputs passed). cumsum, softmax and log_softmax need
every value of their dim on one rank: Replicate there; Shard on any other dim passes through.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..distributed_spec import Partial, Shard
from .pointwise import POINTWISE, pointwise_rule
from .registry import OpSpec, kernel, register
from .rules import Call, Decision, R, RuleRejected, TensorSlot

__all__ = ["REDUCTIONS", "ALONG_DIM", "reduced_dims"]


def reduced_dims(call: Call, dim_at: int = 1) -> tuple[int, ...]:
    ndim = len(call.inputs[0].shape)
    dim = call.param(dim_at, "dim", None)
    if dim is None or isinstance(dim, bool):   # var(x, True): the legacy `unbiased` flag
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(d % max(ndim, 1) for d in dims)) if dims else tuple(range(ndim))


def _value(setting, call: Call):
    return setting(call) if callable(setting) else setting


def reduction_rule(partial_result, partial_inputs, dim_at: int = 1):
    """`partial_result` / `partial_inputs` may be values or functions of the call."""
    def rule(call: Call, placements) -> Decision:
        p, outputs = placements[0], len(call.outputs)
        result, accepted = _value(partial_result, call), _value(partial_inputs, call)
        if isinstance(p, Partial):
            if p.reduce_op not in accepted:
                raise RuleRejected(f"{call.op} does not commute with the reduction of a {p!r} input",
                                   _legal(result, accepted))
            return Decision(placements, (p,) * outputs)
        if not isinstance(p, Shard):
            return Decision(placements, (R,) * outputs)
        dims = reduced_dims(call, dim_at)
        if p.dim in dims:
            if result is None:
                raise RuleRejected(f"{call.op} over sharded dim {p.dim} has no exact partial form",
                                   _legal(result, accepted))
            return Decision(placements, (Partial(result),) * outputs)
        keepdim = len(call.out_shape) == len(call.inputs[0].shape)
        out_dim = p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)
        return Decision(placements, (Shard(out_dim),) * outputs)
    return rule


def _legal(result, accepted) -> str:
    legal = "S(d) on a kept dim, R" + (f", S(d) on a reduced dim (gives P({result}))" if result else "")
    return legal + "".join(f", P({op})" for op in sorted(accepted))


# --- local kernels: a shard's reduction when the whole tensor's needs care -----------------------
def _sharded_reduced_dims(call: Call, placements_nd, dim_at: int = 1) -> bool:
    dims = reduced_dims(call, dim_at)
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


def _reduced_shape(shape, dim, keepdim) -> tuple:
    """The shape a reduction over `dim` (None or () for every dim) leaves; torch cannot tell us
    for an empty input, not even on meta tensors."""
    ndim = len(shape)
    every = dim is None or (not isinstance(dim, int) and len(dim) == 0)
    dims = set(range(ndim)) if every else {d % max(ndim, 1) for d in ((dim,) if isinstance(dim, int) else dim)}
    return tuple(1 if d in dims else size for d, size in enumerate(shape) if keepdim or d not in dims)


def _identity_fill(torch_fn, identity):
    """amax/amin of an empty local shard (uneven tails) is the reduction's identity, not an error."""
    def local(input, dim=None, keepdim=False):
        if input.numel() == 0:
            shape = _reduced_shape(input.shape, dim, keepdim)
            return torch.full(shape, identity(input.dtype), dtype=input.dtype, device=input.device)
        return torch_fn(input, dim if dim is not None else (), keepdim)
    return local


def _lowest(dtype):
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _highest(dtype):
    if dtype == torch.bool:
        return True
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


kernel("amax_safe")(_identity_fill(torch.amax, _lowest))
kernel("amin_safe")(_identity_fill(torch.amin, _highest))


@kernel("norm_inf_safe")
def norm_inf_safe(input, p="fro", dim=None, keepdim=False, dtype=None):
    """max |x| (min |x| for p=-inf) of a shard; an empty shard holds the identity."""
    if input.numel() == 0:
        shape = _reduced_shape(input.shape, dim, keepdim)
        return torch.full(shape, 0.0 if p > 0 else math.inf, dtype=dtype or input.dtype, device=input.device)
    return torch.norm(input, p, dim, keepdim, dtype=dtype)


def _norm_order(call: Call):
    return call.param(1, "p", "fro")


def _norm_partial(call: Call):
    """p=1 and p=0 give P(sum), p=inf P(max), p=-inf P(min); other p need R on reduced dims"""
    return {1: "sum", 0: "sum", math.inf: "max", -math.inf: "min"}.get(_norm_order(call))


def _norm_local(call: Call, placements_nd):
    return ("norm_inf_safe", {}) if _norm_order(call) in (math.inf, -math.inf) else ("norm", {})


def _on_bool(op: str):
    def accepted(call: Call) -> frozenset:
        return frozenset({op}) if call.inputs[0].dtype == torch.bool else frozenset()
    accepted.__doc__ = f"P({op}) passes on bool inputs"
    return accepted


# --- max / min: three torch overloads behind one name ------------------------------------------
def _max_rule(kind: str):
    elementwise = pointwise_rule(POINTWISE["maximum" if kind == "max" else "minimum"][1])
    whole = reduction_rule(kind, frozenset({kind}))
    with_indices = reduction_rule(None, frozenset())

    def rule(call: Call, placements) -> Decision:
        if _is_elementwise(call):                 # max(a, b)
            return elementwise(call, placements)
        if call.param(1, "dim") is None:          # max(a): one value, like amax
            return whole(call, placements)
        return with_indices(call, placements)     # max(a, dim): values and indices
    return rule


def _is_elementwise(call: Call) -> bool:
    return type(call.param(1, "other")) is TensorSlot


def _max_local(kind: str):
    def local(call: Call, placements_nd):
        if not _is_elementwise(call) and call.param(1, "dim") is None:
            return f"a{kind}_safe", {}
        return kind, {}
    return local


# name: (torch function, Partial of a sharded reduction, Partial inputs accepted, dim position, local hook)
REDUCTIONS = {
    "sum": (torch.sum, "sum", frozenset({"sum", "avg"}), 1, None),
    "mean": (torch.mean, "sum", frozenset({"sum", "avg"}), 1, _mean_local),
    "amax": (torch.amax, "max", frozenset({"max"}), 1, lambda call, p: ("amax_safe", {})),
    "amin": (torch.amin, "min", frozenset({"min"}), 1, lambda call, p: ("amin_safe", {})),
    "prod": (torch.prod, None, frozenset(), 1, None),
    "var": (torch.var, None, frozenset(), 1, None),
    "std": (torch.std, None, frozenset(), 1, None),
    "logsumexp": (torch.logsumexp, None, frozenset(), 1, None),
    "argmax": (torch.argmax, None, frozenset(), 1, None),
    "argmin": (torch.argmin, None, frozenset(), 1, None),
    "norm": (torch.norm, _norm_partial, frozenset(), 2, _norm_local),
    "any": (torch.any, "max", _on_bool("max"), 1, None),
    "all": (torch.all, "min", _on_bool("min"), 1, None),
}

def _reduction_doc(result, accepted) -> str:
    if callable(result):
        return result.__doc__
    doc = f"a sharded reduced dim gives P({result})" if result else "reduced dims must be R"
    if callable(accepted):
        return doc + "; " + (accepted.__doc__ or "")
    return doc + "".join(f"; P({op}) passes" for op in sorted(accepted))


for _name, (_fn, _result, _inputs, _dim_at, _local) in REDUCTIONS.items():
    register(OpSpec(_name, _fn, reduction_rule(_result, _inputs, _dim_at), "reduction", local=_local,
                    doc=_reduction_doc(_result, _inputs)))

for _kind in ("max", "min"):
    register(OpSpec(_kind, getattr(torch, _kind), _max_rule(_kind), "reduction", local=_max_local(_kind),
                    doc=f"{_kind}(a): like a{_kind}; {_kind}(a, dim): reduced dim R (indices are global); "
                        f"{_kind}(a, b): like {_kind}imum"))


# --- ops along one dim --------------------------------------------------------------------------
def _along_dim(call: Call) -> int:
    ndim = len(call.inputs[0].shape)
    dim = call.param(1, "dim", None)
    if dim is None:   # torch's implicit softmax dim (deprecated there, kept for parity)
        dim = 0 if ndim in (0, 1, 3) else 1
    return dim % max(ndim, 1)


def along_dim_rule(partial_inputs: frozenset):
    def rule(call: Call, placements) -> Decision:
        (p,) = placements[:1]
        if isinstance(p, Partial) and p.reduce_op not in partial_inputs:
            raise RuleRejected(f"{call.op} does not commute with the reduction of a {p!r} input",
                               "R or S(d) off the op's dim" + "".join(f", P({o})" for o in sorted(partial_inputs)))
        if isinstance(p, Shard) and p.dim == _along_dim(call):
            raise RuleRejected(f"{call.op} runs along dim {p.dim}, which is sharded",
                               f"R on dim {p.dim}, S(d) on another dim")
        return Decision(placements, (p,))
    return rule


# name: (torch function, Partial inputs passed through)
ALONG_DIM = {
    "cumsum": (torch.cumsum, frozenset({"sum", "avg"})),
    "softmax": (F.softmax, frozenset()),
    "log_softmax": (F.log_softmax, frozenset()),
}

for _name, (_fn, _inputs) in ALONG_DIM.items():
    passes = "".join(f"; P({op}) passes" for op in sorted(_inputs))
    register(OpSpec(_name, _fn, along_dim_rule(_inputs), "reduction",
                    doc="R on the op's dim; S elsewhere passes" + passes))
