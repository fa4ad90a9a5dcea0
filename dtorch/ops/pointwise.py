"""PURE: elementwise ops. One table: op -> its row, built from (torch function, the Partial laws
it obeys).

Sharding follows the output's dims: inputs sharded on the same output dim stay sharded; a
Replicate input is sliced locally to match (free); a broadcast (size-1) dim stays Replicate.

Partial inputs pass only where the math allows it. Each op declares its laws (`Laws`, in
ops/partial_laws.py):
  linear    f is linear in a group of operands (a + b, a * r, a / r, where(c, a, b)):
            P(sum) passes when every operand of the group is P(sum) and nothing constant is
            added (a + 1 would add the 1 once per rank); P(avg) passes for any operand of the
            group, constants included (an average keeps affine maps).
  monotone  f is non-decreasing (+1) or non-increasing (-1) in an operand (exp, relu, a - r):
            one P(max|min) operand passes, flipped to P(min|max) where f decreases.
  lattice   f distributes over max or min in all its operands at once (maximum(P(max), P(max))).
Every other operand of a Partial call must be Replicate (or a Python scalar).
Ops monotone only on part of the line (log, sqrt) pass P(min) but not P(max): a max's other
contributions may lie outside the domain (an empty uneven shard holds -inf; log(-inf) is nan).
"""
from __future__ import annotations

from numbers import Number
from typing import cast

import torch
import torch.nn.functional as F

from ..spec.placements import Partial, Shard
from ..errors import UnsupportedOpError
from .partial_laws import NONE, Laws, partial_output
from .registry import OpRow, register_family
from .rules import Call, Decision, R, RuleRejected

__all__ = ["POINTWISE", "pointwise_rule", "shard_decision"]

_LEGAL = "matching S(d) on every input, R with S(d) (R is sliced locally), all R"


def shard_decision(call: Call, placements) -> Decision:
    """Shards of broadcastable inputs, aligned on the output's dims (no Partial inputs)."""
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


def pointwise_rule(laws: Laws):
    def rule(call: Call, placements) -> Decision:
        if not any(isinstance(p, Partial) for p in placements):
            return shard_decision(call, placements)
        out = partial_output(call, placements, laws)
        if out is None:
            given = ", ".join(repr(p) for p in placements)
            raise RuleRejected(f"{call.op} does not commute with the reduction of ({given})",
                               f"{laws.describe()}; or no Partial input")
        return Decision(placements, (out,) * len(call.outputs))
    return rule


# --- the laws of the table's ops ---------------------------------------------------------------
def _sign(value) -> int:
    return (value > 0) - (value < 0)


def _alpha(call: Call) -> int:
    return _sign(call.kwargs.get("alpha", 1))


def _true_division(call: Call) -> bool:
    """only without rounding_mode"""
    return call.kwargs.get("rounding_mode") is None


def _cast_linear(call: Call) -> tuple:
    """P(sum|avg) pass casts to a floating dtype at least as precise and wide as the source"""
    source, target = call.inputs[0].dtype, call.outputs[0][1]
    if not (source.is_floating_point and target.is_floating_point):
        return ()    # rounding each contribution of a sum loses more than rounding the sum
    wide, narrow = torch.finfo(target), torch.finfo(source)
    return ((0,),) if wide.eps <= narrow.eps and wide.max >= narrow.max else ()


def _cast_signs(call: Call) -> tuple:
    """Rounding and truncation keep order unless the target is bool or a narrower integer."""
    source, target = call.inputs[0].dtype, call.outputs[0][1]
    if target == torch.bool:
        return (0,)
    if source.is_floating_point and not target.is_floating_point:
        return (0,)   # an empty shard's +-inf has no integer image that keeps the order
    if target.is_floating_point or source == torch.bool:
        return (1,)
    return (1,) if torch.iinfo(target).min <= torch.iinfo(source).min and \
        torch.iinfo(target).max >= torch.iinfo(source).max else (0,)


def _rpow_signs(call: Call) -> tuple:
    """base ** x rises with x for a base above 1 and falls for a base in (0, 1)."""
    base = call.param(1, "other")
    # numbers.Number declares no order; every real number has one (a complex base raises, as in torch)
    return (1 if base > 1 else -1 if 0 < base < 1 else 0,) if isinstance(base, Number) else (0,)  # type: ignore[operator]


def _booleans(call: Call) -> bool:
    """only on bool inputs"""
    return all(spec.dtype == torch.bool for spec in call.inputs)


def _param_sign(position: int, name: str, default):
    return lambda call: (1 if call.param(position, name, default) >= 0 else 0,)


def _logit_signs(call: Call) -> tuple:
    """With eps, logit clamps into [eps, 1 - eps] first and rises on the whole line; without it only
    on [0, 1], which a max's (or a min's) other contributions may leave."""
    return (1,) if call.param(1, "eps", None) is not None else (0,)


def _threshold_signs(call: Call) -> tuple:
    """x where x > threshold, else value: rising when value <= threshold (no step down)."""
    return (1 if call.param(2, "value") <= call.param(1, "threshold") else 0,)


def _rrelu_signs(call: Call) -> tuple:
    """Evaluation mode is leaky_relu with slope (lower + upper) / 2: rising for a slope >= 0."""
    return (1 if call.param(1, "lower", 1 / 8) + call.param(2, "upper", 1 / 3) >= 0 else 0,)


def _rrelu_rule(call: Call, placements) -> Decision:
    """leaky_relu with slope (lower + upper) / 2; training=True only through F.rrelu, which draws
    the slopes from dtorch's random stream (torch_api/methods.py)"""
    if call.param(3, "training", False):
        raise UnsupportedOpError("dtorch.rrelu(..., training=True): the op itself would draw torch's random "
                                 "slopes on each worker; call torch.nn.functional.rrelu(x, training=True) "
                                 "(or torch.rrelu), which draws them from dtorch's stream")
    return _RRELU(call, placements)


def _isreal_rule(call: Call, placements) -> Decision:
    """True everywhere for real dtypes: no reduction of the input's contributions changes it,
    so a Partial input gives R."""
    if call.inputs[0].dtype.is_complex or not any(isinstance(p, Partial) for p in placements):
        return pointwise_rule(NONE)(call, placements)
    return Decision(placements, (R,))


UP = Laws(monotone=(1,))
DOWN = Laws(monotone=(-1,))
# x * a constant (deg2rad, rad2deg): linear, and rising
SCALING = Laws(linear=((0,),), monotone=(1,))
# Rising only on part of the line: all contributions of a P(min) are >= its value, so they stay
# inside the domain whenever the value does (an empty shard holds +inf, also inside).
UP_ON_DOMAIN = Laws(monotone=(1,), monotone_ops=frozenset({"min"}))
ADD = Laws(linear=((0, 1),), monotone=lambda call: (1, _alpha(call)), arithmetic=True)
SUB = Laws(linear=((0, 1),), monotone=lambda call: (1, -_alpha(call)), arithmetic=True)
WHERE = Laws(params=("condition", "input", "other"), linear=((1, 2),), monotone=(0, 1, 1),
             lattice={"max": (1, 2), "min": (1, 2)}, by_value=True)
INCREASING_BOTH = Laws(monotone=(1, -1))        # a > b rises with a, falls with b
DECREASING_BOTH = Laws(monotone=(-1, 1))
# On bools, and = min and or = max: each rises in both operands and distributes over its own op.
AND = Laws(monotone=(1, 1), lattice={"min": (0, 1)}, when=_booleans)
OR = Laws(monotone=(1, 1), lattice={"max": (0, 1)}, when=_booleans)


# Non-decreasing on the whole extended line (+-inf included), so one P(max|min) passes.
_RISING = ("floor", "ceil", "trunc", "round", "atan", "sinh", "asinh", "exp2", "expm1", "sign",
           "isposinf")   # on bools: inf is the top of the order, so isposinf(max) = any(isposinf)
# Non-increasing on the whole extended line: a P(max) becomes a P(min) and back.
_FALLING = ("erfc", "isneginf", "signbit")
# Rising activations of torch.nn.functional (their values at +-inf are finite or +-inf, never nan:
# softsign's inf / inf is, so it is not here). hardshrink steps up at +-lambd, still rising.
_RISING_ACTIVATIONS = ("hardtanh", "relu6", "hardsigmoid", "selu", "celu", "logsigmoid", "tanhshrink",
                       "hardshrink", "softshrink")
_ACTIVATIONS_NO_LAWS = ("hardswish", "mish", "softsign")   # hardswish and mish dip below 0 before rising
# asin, atanh: rising, but on [-1, 1]: a max's or a min's other contributions may lie outside.
# reciprocal falls on each half-line but jumps at 0; fmod, remainder, floor_divide and hypot are
# not monotone in the divisor (and plans key scalars by type, so not in a scalar's sign either).
_NO_LAWS = ("frac", "asin", "acos", "atanh", "cosh", "atan2", "reciprocal", "fmod", "remainder", "floor_divide",
            "hypot", "isclose",
            # periodic, or with poles and turning points
            "tan", "lgamma", "digamma", "i0", "sinc", "polygamma", "mvlgamma",
            # pow's kin; gcd and lcm are not monotone; copysign rises in its sign operand only in the
            # sign bit's order (-0.0 < +0.0), which a reduction of signed zeros or nan may not keep
            "float_power", "gcd", "copysign",
            # x * log(y) is 0 where x is 0 even at y = 0, but a nonzero contribution there gives inf
            "xlogy")


_RRELU_LAWS = Laws(params=("input", "lower", "upper"), monotone=_rrelu_signs, by_value=True)
_RRELU = pointwise_rule(_RRELU_LAWS)


def _lcm(input, other):
    """torch.lcm, without its trap: lcm(int min, int max) divides int min by -1, which kills the
    process (SIGFPE). |int min| has no representation, so no lcm with it has either: 0 there."""
    lowest = torch.iinfo(torch.result_type(input, other)).min
    return torch.lcm(torch.where((input == lowest) | (other == lowest), 0, input), other)


def _leaky_relu(input, negative_slope=0.01, inplace=False):
    return F.leaky_relu(input, negative_slope)   # never in place: a worker's buffers are shared


def _elu(input, alpha=1.0, inplace=False):
    return F.elu(input, alpha)


def _row(torch_fn, laws: Laws, method: bool = True) -> OpRow:
    """A pointwise op: shards follow the output's dims, Partial inputs pass by `laws`."""
    return OpRow(torch_fn, pointwise_rule(laws), scalars_by_type=not laws.by_value, method=method,
                 doc=laws.describe())


POINTWISE = {
    "add": _row(torch.add, ADD),
    "sub": _row(torch.sub, SUB),
    "neg": _row(torch.neg, Laws(linear=((0,),), monotone=(-1,), arithmetic=True)),
    "mul": _row(torch.mul, Laws(linear=((0,), (1,)))),
    "div": _row(torch.div, Laws(linear=((0,),), when=_true_division)),
    "pow": _row(torch.pow, NONE),
    "abs": _row(torch.abs, NONE),
    "square": _row(torch.square, NONE),
    "exp": _row(torch.exp, UP),
    "log": _row(torch.log, UP_ON_DOMAIN),
    "log1p": _row(torch.log1p, UP_ON_DOMAIN),
    "sqrt": _row(torch.sqrt, UP_ON_DOMAIN),
    "rsqrt": _row(torch.rsqrt, Laws(monotone=(-1,), monotone_ops=frozenset({"min"}))),
    "sin": _row(torch.sin, NONE),
    "cos": _row(torch.cos, NONE),
    "tanh": _row(torch.tanh, UP),
    "sigmoid": _row(torch.sigmoid, UP),
    "erf": _row(torch.erf, UP),
    # erfinv: only on (-1, 1), which a P(max|min) contribution may leave; trunc_normal_ uses it
    "erfinv": _row(torch.erfinv, NONE),
    "relu": _row(lambda input, inplace=False: torch.relu(input), UP),
    "gelu": _row(F.gelu, NONE),
    "silu": _row(lambda input, inplace=False: F.silu(input), NONE),
    "leaky_relu": _row(_leaky_relu, Laws(monotone=_param_sign(1, "negative_slope", 0.01), by_value=True)),
    "elu": _row(_elu, Laws(monotone=_param_sign(1, "alpha", 1.0), by_value=True)),
    "softplus": _row(F.softplus, UP),
    "clamp": _row(torch.clamp, Laws(params=("input", "min", "max"), monotone=(1, 1, 1),
                                    lattice={"max": (0, 1), "min": (0, 2)})),
    "where": _row(torch.where, WHERE, method=False),   # x.where(c, y) means where(c, x, y)
    "masked_fill": _row(torch.masked_fill, Laws(params=("input", "mask", "value"), linear=((0,),),
                                                constants=(2,), monotone=(1, 0, 0), by_value=True)),
    "minimum": _row(torch.minimum, Laws(monotone=(1, 1), lattice={"min": (0, 1)})),
    "maximum": _row(torch.maximum, Laws(monotone=(1, 1), lattice={"max": (0, 1)})),
    "eq": _row(torch.eq, NONE),
    "ne": _row(torch.ne, NONE),
    "lt": _row(torch.lt, DECREASING_BOTH),
    "le": _row(torch.le, DECREASING_BOTH),
    "gt": _row(torch.gt, INCREASING_BOTH),
    "ge": _row(torch.ge, INCREASING_BOTH),
    "logical_and": _row(torch.logical_and, AND),
    "logical_or": _row(torch.logical_or, OR),
    "logical_xor": _row(torch.logical_xor, NONE),
    "logical_not": _row(torch.logical_not, Laws(monotone=(-1,), when=_booleans)),
    "bitwise_and": _row(torch.bitwise_and, AND),
    "bitwise_or": _row(torch.bitwise_or, OR),
    "bitwise_xor": _row(torch.bitwise_xor, NONE),
    "bitwise_not": _row(torch.bitwise_not, Laws(monotone=(-1,))),   # ~x = -x - 1: strictly falling, no wrap
    "isnan": _row(torch.isnan, NONE),
    "isinf": _row(torch.isinf, NONE),
    "isfinite": _row(torch.isfinite, NONE),
    # reached through 2 - x, 2 / x, 2 ** x, 2 // x, 2 % x: not methods
    "rsub": _row(lambda input, other, alpha=1: torch.sub(other, input, alpha=alpha),
                 Laws(linear=((0, 1),), monotone=lambda call: (-_alpha(call), 1), arithmetic=True), method=False),
    "rdiv": _row(lambda input, other: torch.div(other, input), NONE, method=False),
    "rpow": _row(lambda input, other: torch.pow(other, input), Laws(monotone=_rpow_signs, by_value=True),
                 method=False),
    "rfloor_divide": _row(lambda input, other: torch.floor_divide(other, input), NONE, method=False),   # 7 // x
    "rremainder": _row(lambda input, other: torch.remainder(other, input), NONE, method=False),        # 7 % x
    "to_dtype": _row(lambda input, dtype: input.to(dtype), Laws(params=("input", "dtype"), linear=_cast_linear,
                                                                monotone=_cast_signs, by_value=True)),
    **{name: _row(getattr(torch, name), UP) for name in _RISING},
    **{name: _row(getattr(torch, name), UP_ON_DOMAIN) for name in ("log2", "log10", "acosh")},
    **{name: _row(getattr(torch, name), NONE, method=name != "polygamma") for name in _NO_LAWS},
    **{name: _row(getattr(torch, name), DOWN) for name in _FALLING},
    # torch.nn.functional's activations: method only where torch.Tensor has one (x.hardshrink())
    **{name: _row(getattr(F, name), UP, method=hasattr(torch.Tensor, name)) for name in _RISING_ACTIVATIONS},
    **{name: _row(getattr(F, name), NONE, method=False) for name in _ACTIVATIONS_NO_LAWS},
    "threshold": _row(F.threshold, Laws(monotone=_threshold_signs, by_value=True), method=False),
    "rrelu": OpRow(F.rrelu, _rrelu_rule, method=False, doc=_RRELU_LAWS.describe() + "; training=True via F.rrelu"),
    "sgn": _row(torch.sgn, UP),    # sign, for real inputs
    "clamp_min": _row(torch.clamp_min, Laws(params=("input", "min"), monotone=(1, 1), lattice={"max": (0, 1)})),
    "clamp_max": _row(torch.clamp_max, Laws(params=("input", "max"), monotone=(1, 1), lattice={"min": (0, 1)})),
    "logaddexp": _row(torch.logaddexp, Laws(monotone=(1, 1))),
    "logaddexp2": _row(torch.logaddexp2, Laws(monotone=(1, 1))),
    # the next float after a towards b: non-decreasing in each (it never passes b)
    "nextafter": _row(torch.nextafter, Laws(monotone=(1, 1))),
    "ldexp": _row(torch.ldexp, Laws(linear=((0,),), monotone=(1, 0))),     # input * 2 ** other
    # 0 below 0, 1 above, `values` at 0: rising in values (the rest are the same on every rank)
    "heaviside": _row(torch.heaviside, Laws(params=("input", "values"), linear=((1,),), affine=True,
                                            monotone=(0, 1))),
    # fmax(nan, b) is b, no more than any other contribution's fmax(c, b) = max(c, b): a min over
    # ranks keeps it, a max does not (a P(max) carrying nan reads nan, whose fmax is b)
    "fmax": _row(torch.fmax, Laws(monotone=(1, 1), monotone_ops=frozenset({"min"}))),
    "fmin": _row(torch.fmin, Laws(monotone=(1, 1), monotone_ops=frozenset({"max"}))),
    "lcm": _row(_lcm, NONE),
    "logit": _row(torch.logit, Laws(monotone=_logit_signs)),
    **{name: _row(getattr(torch, name), SCALING) for name in ("deg2rad", "rad2deg")},
    "isreal": OpRow(torch.isreal, _isreal_rule, doc=" ".join(cast(str, _isreal_rule.__doc__).split())),
    # rising on numbers, but a max (min) that carries nan is nan and nan_to_num sends it to 0
    "nan_to_num": _row(torch.nan_to_num, NONE),
    "lerp": _row(torch.lerp, Laws(params=("input", "end", "weight"), linear=((0, 1),))),
    # input + value * tensor1 * tensor2 (or / tensor2): linear in input with either factor
    "addcmul": _row(torch.addcmul, Laws(params=("input", "tensor1", "tensor2"), linear=((0, 1), (0, 2)),
                                        monotone=(1, 0, 0), arithmetic=True)),
    "addcdiv": _row(torch.addcdiv, Laws(params=("input", "tensor1", "tensor2"), linear=((0, 1),),
                                        monotone=(1, 0, 0), arithmetic=True)),
}

register_family("pointwise", POINTWISE)
