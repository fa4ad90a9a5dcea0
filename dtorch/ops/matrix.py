"""PURE: matrix products, whose rules all derive from an einsum equation.

On one mesh dim, with the equation's letters:
  all R                         -> R
  one P(sum|avg), the rest R    -> the same Partial (products are linear in each operand)
  S on letter L (any inputs)    -> every input holding L is sharded on it (R is sliced locally),
                                   inputs without L stay R; L kept in the output -> S(L's position),
                                   L contracted away -> P(sum)
"mk,kn->mn" thus gives S(0)xR -> S(0), RxS(1) -> S(1), S(1)xS(0) -> P(sum).
"""
from __future__ import annotations

import string

import torch

from ..distributed_spec import Partial, Shard
from .registry import OpSpec, register
from .rules import Call, Decision, R, RuleRejected

__all__ = ["einsum_rule", "matmul_equation"]

_LEGAL = "all R; one P(sum) with R; S on one einsum letter (inputs without it R)"


def _parse(equation: str) -> tuple[list[str], str]:
    inputs, output = equation.replace(" ", "").split("->")
    return inputs.split(","), output


def _letter_decision(call: Call, placements, letters, out, letter) -> Decision:
    required = []
    for spec, p, held in zip(call.inputs, placements, letters):
        if letter not in held:
            if not p.is_replicate():
                raise RuleRejected(f"an input without letter {letter!r} is {p!r}", _LEGAL)
            required.append(p)
            continue
        dim = held.index(letter)
        broadcast = spec.shape[dim] == 1 and _letter_size(call, letters, letter) != 1
        if broadcast and not p.is_replicate():
            raise RuleRejected(f"S({dim}) is on a broadcast dim of size 1", _LEGAL)
        required.append(p if broadcast else Shard(dim))
    result = Shard(out.index(letter)) if letter in out else Partial("sum")
    return Decision(tuple(required), (result,))


def _letter_size(call: Call, letters, letter) -> int:
    return max(spec.shape[held.index(letter)] for spec, held in zip(call.inputs, letters) if letter in held)


def einsum_decision(call: Call, placements, equation: str) -> Decision:
    letters, out = _parse(equation)
    partials = [p for p in placements if isinstance(p, Partial)]
    sharded_letters = {held[p.dim] for p, held in zip(placements, letters) if isinstance(p, Shard)}
    if partials:
        if len(partials) == 1 and not sharded_letters and partials[0].reduce_op in ("sum", "avg"):
            return Decision(placements, (partials[0],))
        raise RuleRejected("a product takes at most one Partial input, with every other input R", _LEGAL)
    if not sharded_letters:
        return Decision(placements, (R,))
    if len(sharded_letters) > 1:
        raise RuleRejected(f"inputs are sharded on different letters {sorted(sharded_letters)} of "
                           f"{equation!r}", _LEGAL)
    return _letter_decision(call, placements, letters, out, sharded_letters.pop())


def einsum_rule(equation_of):
    """A rule from a function call -> einsum equation (fixed for mm, rank-dependent for matmul)."""
    def rule(call: Call, placements) -> Decision:
        return einsum_decision(call, placements, equation_of(call))
    return rule


def matmul_equation(call: Call) -> str:
    """torch.matmul's rank cases as one einsum equation, batch dims broadcast from the right."""
    a, b = (len(spec.shape) for spec in call.inputs)
    batch = string.ascii_lowercase[:max(a, b, 2) - 2]
    if a == 1 and b == 1:
        return "y,y->"
    if a == 1:
        return f"y,{batch[len(batch) - (b - 2):]}yz->{batch[len(batch) - (b - 2):]}z"
    if b == 1:
        return f"{batch[len(batch) - (a - 2):]}xy,y->{batch[len(batch) - (a - 2):]}x"
    a_batch, b_batch = batch[len(batch) - (a - 2):], batch[len(batch) - (b - 2):]
    return f"{a_batch}xy,{b_batch}yz->{batch}xz"


register(OpSpec("matmul", torch.matmul, einsum_rule(matmul_equation), "matrix"))
register(OpSpec("mm", torch.mm, einsum_rule(lambda call: "xy,yz->xz"), "matrix"))
register(OpSpec("bmm", torch.bmm, einsum_rule(lambda call: "bxy,byz->bxz"), "matrix"))
