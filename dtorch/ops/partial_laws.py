"""PURE: the Partial algebra. An op's `Laws` say which Partial inputs pass through it (linear,
monotone, lattice: ops/pointwise.py's docstring says each in words) and `partial_output` applies
them to one call on one mesh dim. Pointwise ops and some nn ops (layer_norm's weight and bias,
cross_entropy's weight) declare laws.
"""
from __future__ import annotations

from numbers import Number
from collections.abc import Callable
from typing import NamedTuple, cast

import torch

from ..spec.placements import Partial
from .rules import Call, TensorSlot

__all__ = ["Laws", "NONE", "partial_output"]


class Laws(NamedTuple):
    params: tuple = ("input", "other")    # parameter names in order: maps kwargs to positions
    linear: tuple | Callable = ()         # groups of positions f is jointly linear in (or call -> them)
    affine: bool | tuple = False          # f always adds a constant of its own (True), or only in the
                                          # linear groups that hold one of these positions
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
            parts.append(cast(str, self.linear.__doc__).strip())
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
    affine = laws.affine if type(laws.affine) is bool else any(p in group for p in laws.affine)
    if affine or not any(p in group for p in partial_positions):
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
