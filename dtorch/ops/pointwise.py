"""PURE: elementwise ops. One table: op -> (torch function, the Partial laws it obeys).

Sharding follows the output's dims: inputs sharded on the same output dim stay sharded; a
Replicate input is sliced locally to match (free); a broadcast (size-1) dim stays Replicate.

Partial inputs pass only where the math allows it. Each op declares its laws (see `Laws`):
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
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..distributed_spec import Partial, Shard
from .registry import OpSpec, register
from .rules import Call, Decision, R, RuleRejected, TensorSlot

__all__ = ["POINTWISE", "Laws", "pointwise_rule", "partial_output", "shard_decision", "BINARY_OPERATORS",
           "UNARY_OPERATORS"]

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


# --- Partial laws -------------------------------------------------------------------------------
class Laws(NamedTuple):
    params: tuple = ("input", "other")    # parameter names in order: maps kwargs to positions
    linear: tuple | Callable = ()         # groups of positions f is jointly linear in (or call -> them)
    affine: bool = False                  # f always adds a constant of its own
    constants: tuple = ()                 # positions of values f adds when nonzero (masked_fill's value)
    monotone: tuple | Callable = ()       # per position +1 / -1 / 0, or call -> that tuple
    monotone_ops: frozenset = frozenset({"max", "min"})   # P(min) only where f has a domain edge
    lattice: dict = {}                    # reduce op -> positions f distributes it over all at once
    arithmetic: bool = False              # order laws need infinities that cannot meet or wrap (below)
    when: Callable | None = None          # call -> bool: the laws hold at all (dtype, kwargs)
    by_value: bool = False                # plans key scalars by value, so laws may read them

    def describe(self) -> str:
        parts = []
        if callable(self.linear):
            parts.append(self.linear.__doc__.strip())
        elif self.linear:
            groups = " or ".join("(" + ", ".join(self.params[i] for i in g) + ")" for g in self.linear)
            parts.append(f"linear in {groups}: P(avg)" + ("" if self.affine else ", P(sum) without constants"))
        if self.monotone:
            ops = "|".join(sorted(self.monotone_ops))
            parts.append(f"monotone: one P({ops})" + (" (flips where decreasing)" if self.monotone != (1,) else "")
                         + (" on floats, other operands without P(max|min)" if self.arithmetic else ""))
        for op, positions in self.lattice.items():
            parts.append(f"distributes over {op}: P({op}) on " + ", ".join(self.params[i] for i in positions))
        if self.when is not None and self.when.__doc__:
            parts.append(self.when.__doc__.strip())
        return "; ".join(parts) or "none: reduce Partial inputs first"


NONE = Laws()
_FLIP = {"max": "min", "min": "max", "sum": "sum", "avg": "avg"}


def _positions(call: Call, params) -> list:
    """The parameter position of each tensor input, in input order."""
    where = {}
    for position, value in enumerate(call.args):
        if type(value) is TensorSlot:
            where[value.index] = position
    for name, value in call.kwargs.items():
        if type(value) is TensorSlot:
            where[value.index] = params.index(name) if name in params else len(params)
    return [where.get(i, -1) for i in range(len(call.inputs))]


def _zero(call: Call, laws: Laws, position: int) -> bool:
    """A scalar 0 there: it adds nothing, however many ranks add it. Only readable when plans
    key scalars by value (by type, one plan serves x + 0 and x + 1)."""
    value = call.param(position, laws.params[position]) if position < len(laws.params) else None
    return laws.by_value and isinstance(value, Number) and value == 0


def _sums_through(call: Call, laws: Laws, group, partial_positions: set) -> bool:
    """P(sum) inputs fill the whole linear group (or zeros do) and nothing else is added."""
    if laws.affine or not any(p in group for p in partial_positions):
        return False
    filled = all(p in partial_positions or _zero(call, laws, p) for p in group)
    return filled and all(_zero(call, laws, p) for p in laws.constants)


def partial_output(call: Call, placements, laws: Laws):
    """The Partial an op's output is when `laws` let its Partial inputs through, else None."""
    partial_at = {pos: p.reduce_op for pos, p in zip(_positions(call, laws.params), placements)
                  if isinstance(p, Partial)}
    ops = set(partial_at.values())
    if len(ops) != 1 or any(not p.is_replicate() for p in placements if not isinstance(p, Partial)):
        return None
    if laws.when is not None and not laws.when(call):
        return None
    (op,) = ops
    if op in ("sum", "avg"):
        return _linear_output(call, laws, op, set(partial_at))
    signs = laws.monotone(call) if callable(laws.monotone) else laws.monotone
    if laws.arithmetic and not _order_safe(call, _positions(call, laws.params), signs):
        return None
    if len(partial_at) == 1 and op in laws.monotone_ops:
        (position,) = partial_at
        sign = signs[position] if position < len(signs) else 0
        if sign:
            return Partial(op if sign > 0 else _FLIP[op])
    if set(partial_at) <= set(laws.lattice.get(op, ())):
        return Partial(op)
    return None


def _order_safe(call: Call, positions, signs) -> bool:
    """x + y keeps a max only while the identities P(max|min) contributions may hold (-inf, +inf,
    an integer's minimum on an empty shard) stay put: not when integers wrap around, and not when
    two operands' infinities meet with opposite signs (on other mesh dims: -inf - -inf is nan)."""
    if not call.outputs[0][1].is_floating_point:
        return False
    infinities = []   # per operand: the signs of the infinities it may add
    for position, spec in zip(positions, call.inputs):
        ops = {p.reduce_op for p in spec.placements if isinstance(p, Partial) and p.reduce_op in ("max", "min")}
        sign = signs[position] if 0 <= position < len(signs) else 0
        if ops and not sign:
            return False          # alpha=0: 0 * inf is nan
        infinities.append({sign if op == "min" else -sign for op in ops})
    return not any(a != b for i, mine in enumerate(infinities) for theirs in infinities[i + 1:]
                   for a in mine for b in theirs)


def _linear_output(call: Call, laws: Laws, op: str, partial_positions: set):
    if call.outputs[0][1] == torch.bool:    # sums of booleans are not booleans
        return None
    for group in (laws.linear(call) if callable(laws.linear) else laws.linear):
        if not partial_positions <= set(group):
            continue
        if op == "avg":
            return Partial("avg")
        if _sums_through(call, laws, group, partial_positions):
            return Partial("sum")
    return None


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
    return (1 if base > 1 else -1 if 0 < base < 1 else 0,) if isinstance(base, Number) else (0,)


def _booleans(call: Call) -> bool:
    """only on bool inputs"""
    return all(spec.dtype == torch.bool for spec in call.inputs)


def _param_sign(position: int, name: str, default):
    return lambda call: (1 if call.param(position, name, default) >= 0 else 0,)


UP = Laws(monotone=(1,))
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


def _leaky_relu(input, negative_slope=0.01, inplace=False):
    return F.leaky_relu(input, negative_slope)   # never in place: a worker's buffers are shared


def _elu(input, alpha=1.0, inplace=False):
    return F.elu(input, alpha)


# name: (torch function, Partial laws)
POINTWISE = {
    "add": (torch.add, ADD),
    "sub": (torch.sub, SUB),
    "neg": (torch.neg, Laws(linear=((0,),), monotone=(-1,), arithmetic=True)),
    "mul": (torch.mul, Laws(linear=((0,), (1,)))),
    "div": (torch.div, Laws(linear=((0,),), when=_true_division)),
    "pow": (torch.pow, NONE),
    "abs": (torch.abs, NONE),
    "square": (torch.square, NONE),
    "exp": (torch.exp, UP),
    "log": (torch.log, UP_ON_DOMAIN),
    "log1p": (torch.log1p, UP_ON_DOMAIN),
    "sqrt": (torch.sqrt, UP_ON_DOMAIN),
    "rsqrt": (torch.rsqrt, Laws(monotone=(-1,), monotone_ops=frozenset({"min"}))),
    "sin": (torch.sin, NONE),
    "cos": (torch.cos, NONE),
    "tanh": (torch.tanh, UP),
    "sigmoid": (torch.sigmoid, UP),
    "erf": (torch.erf, UP),
    "relu": (lambda input, inplace=False: torch.relu(input), UP),
    "gelu": (F.gelu, NONE),
    "silu": (lambda input, inplace=False: F.silu(input), NONE),
    "leaky_relu": (_leaky_relu, Laws(monotone=_param_sign(1, "negative_slope", 0.01), by_value=True)),
    "elu": (_elu, Laws(monotone=_param_sign(1, "alpha", 1.0), by_value=True)),
    "softplus": (F.softplus, UP),
    "clamp": (torch.clamp, Laws(params=("input", "min", "max"), monotone=(1, 1, 1),
                                lattice={"max": (0, 1), "min": (0, 2)})),
    "where": (torch.where, WHERE),
    "masked_fill": (torch.masked_fill, Laws(params=("input", "mask", "value"), linear=((0,),),
                                            constants=(2,), monotone=(1, 0, 0), by_value=True)),
    "minimum": (torch.minimum, Laws(monotone=(1, 1), lattice={"min": (0, 1)})),
    "maximum": (torch.maximum, Laws(monotone=(1, 1), lattice={"max": (0, 1)})),
    "eq": (torch.eq, NONE),
    "ne": (torch.ne, NONE),
    "lt": (torch.lt, DECREASING_BOTH),
    "le": (torch.le, DECREASING_BOTH),
    "gt": (torch.gt, INCREASING_BOTH),
    "ge": (torch.ge, INCREASING_BOTH),
    "logical_and": (torch.logical_and, AND),
    "logical_or": (torch.logical_or, OR),
    "logical_xor": (torch.logical_xor, NONE),
    "logical_not": (torch.logical_not, Laws(monotone=(-1,), when=_booleans)),
    "bitwise_and": (torch.bitwise_and, AND),
    "bitwise_or": (torch.bitwise_or, OR),
    "bitwise_xor": (torch.bitwise_xor, NONE),
    "bitwise_not": (torch.bitwise_not, Laws(monotone=(-1,))),   # ~x = -x - 1: strictly falling, no wrap
    "isnan": (torch.isnan, NONE),
    "isinf": (torch.isinf, NONE),
    "isfinite": (torch.isfinite, NONE),
    "rsub": (lambda input, other, alpha=1: torch.sub(other, input, alpha=alpha),
             Laws(linear=((0, 1),), monotone=lambda call: (-_alpha(call), 1), arithmetic=True)),
    "rdiv": (lambda input, other: torch.div(other, input), NONE),
    "rpow": (lambda input, other: torch.pow(other, input), Laws(monotone=_rpow_signs, by_value=True)),
    "to_dtype": (lambda input, dtype: input.to(dtype), Laws(params=("input", "dtype"), linear=_cast_linear,
                                                            monotone=_cast_signs, by_value=True)),
}

_REFLECTED = {"rsub", "rdiv", "rpow"}    # reached through 2 - x, 2 / x, 2 ** x; not methods
_NOT_METHODS = _REFLECTED | {"where"}    # x.where(c, y) means where(c, x, y) in torch

for _name, (_fn, _laws) in POINTWISE.items():
    register(OpSpec(_name, _fn, pointwise_rule(_laws), "pointwise", scalars_by_type=not _laws.by_value,
                    method=_name not in _NOT_METHODS, doc=_laws.describe()))

# Python operators map onto the table (the tensor module wires them as dunder methods).
BINARY_OPERATORS = {
    "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div", "__pow__": "pow",
    "__radd__": "add", "__rmul__": "mul", "__rsub__": "rsub", "__rtruediv__": "rdiv",
    "__rpow__": "rpow", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le",
    "__gt__": "gt", "__ge__": "ge", "__and__": "bitwise_and", "__or__": "bitwise_or",
    "__xor__": "bitwise_xor", "__rand__": "bitwise_and", "__ror__": "bitwise_or", "__rxor__": "bitwise_xor",
}
UNARY_OPERATORS = {"__neg__": "neg", "__abs__": "abs", "__invert__": "bitwise_not"}
