"""PURE: elementwise ops. One table: op -> (torch function, how it treats Partial inputs).

Sharding follows the output's dims: inputs sharded on the same output dim stay sharded; a
Replicate input is sliced locally to match (free); a broadcast (size-1) dim stays Replicate.
Partial inputs pass only where the math allows it, named by the op's `partial` class:
  additive  a + b, a - b:          all tensor inputs P(sum) (or all P(avg)); no scalar added;
                                   or P(max|min) plus Replicate / scalars (shifts keep the max)
  negate    -a:                    P(sum|avg) only (negation turns a max into a min)
  scale     a * r:                 one P(sum|avg) input, the rest Replicate or scalars
  numerator a / r:                 the first input P(sum|avg), the rest Replicate or scalars
  monotone  exp(a), relu(a), a+c:  P(max) / P(min) survive non-decreasing maps
  none      anything else:         Partial must be reduced first
"""
from __future__ import annotations

import operator
from numbers import Number

import torch

from ..distributed_spec import Partial, Shard
from .registry import OpSpec, register
from .rules import Call, Decision, R, RuleRejected

__all__ = ["POINTWISE"]

_LEGAL = "matching S(d) on every input, R with S(d) (R is sliced locally), all R"


def _shard_decision(call: Call, placements) -> Decision:
    out_shape = call.out_shape
    out_ndim = len(out_shape)
    sharded_out_dims = set()
    for spec, p in zip(call.inputs, placements):
        if isinstance(p, Shard):
            out_dim = p.dim + out_ndim - len(spec.shape)
            if spec.shape[p.dim] != out_shape[out_dim]:
                raise RuleRejected(f"S({p.dim}) is on a broadcast dim of size 1", _LEGAL)
            sharded_out_dims.add(out_dim)
    if not sharded_out_dims:
        return Decision(placements, (R,) * len(call.outputs))
    if len(sharded_out_dims) > 1:
        raise RuleRejected("inputs are sharded on different dims of the result", _LEGAL)
    out_dim = sharded_out_dims.pop()
    required = []
    for spec, p in zip(call.inputs, placements):
        in_dim = out_dim - (out_ndim - len(spec.shape))
        broadcast = in_dim < 0 or spec.shape[in_dim] != out_shape[out_dim]
        required.append(p if broadcast or isinstance(p, Shard) else Shard(in_dim))
    return Decision(tuple(required), (Shard(out_dim),) * len(call.outputs))


def _has_scalar_operand(call: Call) -> bool:
    return any(isinstance(a, Number) and not isinstance(a, bool) for a in call.args)


def _partial_decision(call: Call, placements, partial_class: str) -> Decision:
    partials = [p for p in placements if isinstance(p, Partial)]
    ops = {p.reduce_op for p in partials}
    others_replicate = all(p.is_replicate() for p in placements if not isinstance(p, Partial))
    out = None
    if partial_class in ("additive", "negate") and len(partials) == len(placements) \
            and len(ops) == 1 and ops <= {"sum", "avg"} and not _has_scalar_operand(call):
        out = partials[0]
    elif partial_class in ("scale", "numerator") and len(partials) == 1 and others_replicate \
            and ops <= {"sum", "avg"} and (partial_class == "scale" or placements[0].is_partial()):
        out = partials[0]
    elif partial_class in ("monotone", "additive") and len(partials) == 1 and others_replicate \
            and ops <= {"max", "min"} and placements[0].is_partial():
        out = partials[0]
    if out is None:
        raise RuleRejected(f"{call.op} does not commute with the reduction of {partials[0]!r} inputs",
                           _PARTIAL_LEGAL[partial_class])
    return Decision(placements, (out,) * len(call.outputs))


_PARTIAL_LEGAL = {
    "additive": "P(sum)+P(sum), P(avg)+P(avg), P(max|min) with R/scalar, or no Partial input",
    "negate": "P(sum) or P(avg), or no Partial input",
    "scale": "one P(sum|avg) times R or a scalar, or no Partial input",
    "numerator": "P(sum|avg) / R or a scalar, or no Partial input",
    "monotone": "P(max|min) alone, or no Partial input",
    "none": "no Partial input: redistribute it to Replicate or Shard first",
}


def pointwise_rule(partial_class: str):
    def rule(call: Call, placements) -> Decision:
        if any(isinstance(p, Partial) for p in placements):
            return _partial_decision(call, placements, partial_class)
        return _shard_decision(call, placements)
    return rule


# name: (torch function, partial class)
POINTWISE = {
    "add": (torch.add, "additive"),
    "sub": (torch.sub, "additive"),
    "neg": (torch.neg, "negate"),
    "mul": (torch.mul, "scale"),
    "div": (torch.div, "numerator"),
    "pow": (torch.pow, "none"),
    "abs": (torch.abs, "none"),
    "exp": (torch.exp, "monotone"),
    "log": (torch.log, "monotone"),
    "sqrt": (torch.sqrt, "monotone"),
    "tanh": (torch.tanh, "monotone"),
    "sigmoid": (torch.sigmoid, "monotone"),
    "relu": (torch.relu, "monotone"),
    "eq": (torch.eq, "none"),
    "ne": (torch.ne, "none"),
    "lt": (torch.lt, "none"),
    "le": (torch.le, "none"),
    "gt": (torch.gt, "none"),
    "ge": (torch.ge, "none"),
    "rsub": (lambda input, other, alpha=1: torch.sub(other, input, alpha=alpha), "none"),
    "rdiv": (lambda input, other: torch.div(other, input), "none"),
    "rpow": (lambda input, other: torch.pow(other, input), "none"),
    "to_dtype": (lambda input, dtype: input.to(dtype), "monotone"),
}

_REFLECTED = {"rsub", "rdiv", "rpow"}  # reached through 2 - x, 2 / x, 2 ** x; not methods

for _name, (_fn, _partial_class) in POINTWISE.items():
    register(OpSpec(_name, _fn, pointwise_rule(_partial_class), "pointwise",
                    scalars_by_type=_name != "to_dtype", method=_name not in _REFLECTED))

# Python operators map onto the table (the tensor module wires them as dunder methods).
BINARY_OPERATORS = {
    "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div", "__pow__": "pow",
    "__radd__": "add", "__rmul__": "mul", "__rsub__": "rsub", "__rtruediv__": "rdiv",
    "__rpow__": "rpow", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le",
    "__gt__": "gt", "__ge__": "ge",
}
UNARY_OPERATORS = {"__neg__": "neg", "__abs__": "abs"}
_ = operator  # the dunder names above are operator's own spellings
