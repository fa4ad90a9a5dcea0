"""PURE: reductions over dims and ops along one dim. Two tables.

REDUCTIONS: op -> its row, built from (torch function, the Partial a reduction over a sharded
dim yields, the Partial inputs it passes through, where its `dim` argument sits, local hook).
Reducing over a sharded dim communicates nothing: each rank reduces its shard and the result is
Partial (sum -> P(sum), amax -> P(max), any -> P(max) on bool, which Gloo reduces natively); the
reduction finishes when the user reads or redistributes. Ops with no exact partial form (prod,
var, logsumexp, argmax, max with indices, nanmean: its count of non-nan elements) need Replicate
on reduced dims.

ALONG_DIM: op -> its row, built from (torch function, Partial inputs passed). cumsum, cumprod,
cummax, cummin, logcumsumexp, softmax, log_softmax, softmin and glu need every value of their
dim on one rank: Replicate there; Shard on any other dim passes through. Only cumsum is linear, so only it passes
P(sum) and P(avg); the others take no Partial (a product, a running max's indices, a log of a sum
of exps do not commute with summing or maxing the contributions).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..spec.placements import Partial, Shard
from .pointwise import POINTWISE
from .registry import OpRow, kernel, register_family
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
    return tuple([1 if d in dims else size for d, size in enumerate(shape) if keepdim or d not in dims])


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
    elementwise = POINTWISE["maximum" if kind == "max" else "minimum"].rule
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


def _reduction(torch_fn, partial_result, partial_inputs, dim_at: int = 1, local=None) -> OpRow:
    """partial_result: the Partial of a reduction over a sharded dim (None: no exact partial form);
    partial_inputs: the Partial inputs it passes through; dim_at: where its `dim` argument sits."""
    return OpRow(torch_fn, reduction_rule(partial_result, partial_inputs, dim_at), local=local,
                 doc=_reduction_doc(partial_result, partial_inputs))


def _reduction_doc(result, accepted) -> str:
    if callable(result):
        return result.__doc__
    doc = f"a sharded reduced dim gives P({result})" if result else "reduced dims must be R"
    if callable(accepted):
        return doc + "; " + (accepted.__doc__ or "")
    return doc + "".join(f"; P({op}) passes" for op in sorted(accepted))


def _max_row(kind: str) -> OpRow:
    return OpRow(getattr(torch, kind), _max_rule(kind), local=_max_local(kind),
                 doc=f"{kind}(a): like a{kind}; {kind}(a, dim): reduced dim R (indices are global); "
                     f"{kind}(a, b): like {kind}imum")


REDUCTIONS = {
    "sum": _reduction(torch.sum, "sum", frozenset({"sum", "avg"})),
    # nan counts as 0, so a shard's nansum is its share of the whole's; but no Partial input passes:
    # contributions inf and -inf reduce to nan, which the whole's nansum skips and theirs do not
    "nansum": _reduction(torch.nansum, "sum", frozenset()),
    # the divisor is the count of non-nan elements, which no rank knows alone: R on reduced dims
    "nanmean": _reduction(torch.nanmean, None, frozenset()),
    "mean": _reduction(torch.mean, "sum", frozenset({"sum", "avg"}), local=_mean_local),
    "amax": _reduction(torch.amax, "max", frozenset({"max"}), local=lambda call, p: ("amax_safe", {})),
    "amin": _reduction(torch.amin, "min", frozenset({"min"}), local=lambda call, p: ("amin_safe", {})),
    "prod": _reduction(torch.prod, None, frozenset()),
    "var": _reduction(torch.var, None, frozenset()),
    "std": _reduction(torch.std, None, frozenset()),
    "logsumexp": _reduction(torch.logsumexp, None, frozenset()),
    "argmax": _reduction(torch.argmax, None, frozenset()),
    "argmin": _reduction(torch.argmin, None, frozenset()),
    "norm": _reduction(torch.norm, _norm_partial, frozenset(), dim_at=2, local=_norm_local),
    "any": _reduction(torch.any, "max", _on_bool("max")),
    "all": _reduction(torch.all, "min", _on_bool("min")),
    "max": _max_row("max"),
    "min": _max_row("min"),
}
register_family("reduction", REDUCTIONS)


# --- ops along one dim --------------------------------------------------------------------------
def _along_dim(call: Call, default_dim=None) -> int:
    ndim = len(call.inputs[0].shape)
    dim = call.param(1, "dim", default_dim)
    if dim is None:   # torch's implicit softmax dim (deprecated there, kept for parity)
        dim = 0 if ndim in (0, 1, 3) else 1
    return dim % max(ndim, 1)


def along_dim_rule(partial_inputs: frozenset, default_dim=None):
    """`default_dim`: the op's dim when the call names none (None: softmax's implicit dim)."""
    def rule(call: Call, placements) -> Decision:
        (p,) = placements[:1]
        if isinstance(p, Partial) and p.reduce_op not in partial_inputs:
            raise RuleRejected(f"{call.op} does not commute with the reduction of a {p!r} input",
                               "R or S(d) off the op's dim" + "".join(f", P({o})" for o in sorted(partial_inputs)))
        if isinstance(p, Shard) and p.dim == _along_dim(call, default_dim):
            raise RuleRejected(f"{call.op} runs along dim {p.dim}, which is sharded",
                               f"R on dim {p.dim}, S(d) on another dim")
        return Decision(placements, (p,) * len(call.outputs))   # cummax, cummin: values and indices alike
    return rule


def _along(torch_fn, partial_inputs: frozenset, default_dim=None) -> OpRow:
    passes = "".join(f"; P({op}) passes" for op in sorted(partial_inputs))
    return OpRow(torch_fn, along_dim_rule(partial_inputs, default_dim),
                 doc="R on the op's dim; S elsewhere passes" + passes)


ALONG_DIM = {
    "cumsum": _along(torch.cumsum, frozenset({"sum", "avg"})),
    "cumprod": _along(torch.cumprod, frozenset()),
    "cummax": _along(torch.cummax, frozenset()),
    "cummin": _along(torch.cummin, frozenset()),
    "logcumsumexp": _along(torch.logcumsumexp, frozenset()),
    "softmax": _along(F.softmax, frozenset()),
    "log_softmax": _along(F.log_softmax, frozenset()),
    "softmin": _along(F.softmin, frozenset()),
    # its dim splits in halves a * sigmoid(b): a shard of it would pair the wrong halves
    "glu": _along(F.glu, frozenset(), default_dim=-1),
}
register_family("reduction", ALONG_DIM)
