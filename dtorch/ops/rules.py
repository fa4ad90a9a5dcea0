"""PURE: the vocabulary of placement rules and the one function that expands a rule written for
ONE mesh dimension to an N-D mesh.

A rule sees a `Call` (input specs, the non-tensor arguments, the output shapes from meta
inference) and the inputs' placements on one mesh dim. It answers with a `Decision`: the
placement each input must have there (the given one, or Replicate -> Shard(d), a local slice
that costs no communication) and the placement of each output. It refuses with `RuleRejected`,
which names the legal alternatives; `expand` turns that into a PlacementError for the user.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..spec.placements import Partial, Placement, Replicate, Shard, format_placements
from ..errors import PlacementError, user_site
from .rule_call import Call, Decision, Rule, RuleRejected, TensorSlot
from .suggest import cheapest_fix, describe_legal, legal_combinations, placement_code

__all__ = ["Call", "Decision", "RuleRejected", "Rule", "expand", "try_expand", "Refusal", "TensorSlot", "R",
           "all_replicate", "shard_of", "common_shard_dim", "partial_op", "unshard_fix", "normalize_dim", "follow_rule",
           "off_dim"]

R = Replicate()


class Refusal(NamedTuple):
    """Where `try_expand` stopped: the mesh dim whose placements the rule refused, and why."""
    mesh_dim: int
    placements: tuple
    rejected: RuleRejected


def expand(rule: Rule, call: Call) -> tuple[list[tuple], list[tuple]]:
    """Apply a 1-D rule to every mesh dim; return (required input placements, output placements)."""
    outcome = try_expand(rule, call)
    if type(outcome) is Refusal:
        site = user_site()   # now: the message itself is worded only if someone reads it
        raise PlacementError(_Worded(lambda: _rejection_message(rule, call, *outcome, site))) from None
    return outcome


class _Worded:
    """An error message composed when first read. Wording a refusal searches every legal
    combination and costs the cheapest fix (milliseconds); callers that only test whether a
    layout is accepted (the sweeps, docs/reference/ops.md's generator, strict-mode probes) never read it."""
    __slots__ = ("_compose", "_text")

    def __init__(self, compose):
        self._compose, self._text = compose, None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._compose()
        return self._text

    __repr__ = __str__


def try_expand(rule: Rule, call: Call):
    """`expand`, but a refusal comes back as a Refusal instead of a worded PlacementError: the
    automatic redistribute (ops/auto_redistribute.py) needs the mesh dim, not the message."""
    required: list[list] = [[] for _ in call.inputs]
    outputs: list[list] = [[] for _ in call.outputs]
    for mesh_dim in range(call.mesh.ndim):
        placements = tuple([spec.placements[mesh_dim] for spec in call.inputs])
        try:
            decision = rule(call, placements)
        except RuleRejected as rejected:
            return Refusal(mesh_dim, placements, rejected)
        for slot, placement in zip(required, decision.inputs):
            slot.append(placement)
        for slot, placement in zip(outputs, decision.outputs):
            slot.append(placement)
    return [tuple(p) for p in required], [tuple(p) for p in outputs]


def _rejection_message(rule: Rule, call: Call, mesh_dim: int, placements, rejected: RuleRejected, site: str) -> str:
    mesh = call.mesh
    name = f" ({mesh.mesh_dim_names[mesh_dim]!r})" if mesh.mesh_dim_names else ""
    given = ", ".join(f"{format_placements(s.placements)} shape={tuple(s.shape)}" for s in call.inputs)
    on_dim = ", ".join(map(repr, placements))
    legal = legal_combinations(rule, call, mesh_dim)
    # no concrete combination fits (a shape the op refuses on any layout): the rule's own words
    legal_there = describe_legal(legal) if legal else rejected.legal
    fix = (cheapest_fix(call, mesh_dim, legal) if legal else
           "redistribute an input first, e.g. x.redistribute(placements=[...Replicate()...])")
    return (f"{call.op}: inputs {given} on {mesh} at {site}: on mesh dim {mesh_dim}{name} the "
            f"placements ({on_dim}) are not accepted: {rejected.reason}. Legal there: {legal_there}. "
            f"Fix: {fix}.")


# --- small helpers the family tables share ----------------------------------------------------
def all_replicate(placements: Sequence[Placement]) -> bool:
    return all(p.is_replicate() for p in placements)


def shard_of(placement: Placement) -> int | None:
    return placement.dim if isinstance(placement, Shard) else None


def common_shard_dim(placements, legal: str) -> int | None:
    """The one tensor dim that every sharded input is sharded on (None when none is sharded)."""
    dims = {p.dim for p in placements if isinstance(p, Shard)}
    if len(dims) > 1:
        raise RuleRejected(f"inputs are sharded on different dims {sorted(dims)}", legal)
    return dims.pop() if dims else None


def partial_op(placement: Placement) -> str | None:
    return placement.reduce_op if isinstance(placement, Partial) else None


def unshard_fix(call: Call, replaced, input_index: int = 0, name: str = "x") -> str:
    """The redistribute that makes the op legal: `replaced` placements of one input -> Replicate."""
    placements = call.inputs[input_index].placements
    codes = ", ".join("Replicate()" if p == replaced else placement_code(p) for p in placements)
    return f"redistribute with {name}.redistribute(placements=[{codes}]) first"


def normalize_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def follow_rule(out_dim_of, legal: str, partial_ok: bool = True):
    """A rule for one-input ops whose result dims follow the input's: S(d) -> S(out_dim_of(call,
    d)) (which raises RuleRejected where d cannot follow), R -> R, Partial -> the same Partial
    unless the op compares values (topk, sort). Every output gets the same placement."""
    def rule(call: Call, placements) -> Decision:
        (p,) = placements
        if isinstance(p, Shard):
            p_out = Shard(out_dim_of(call, p.dim))
        elif isinstance(p, Partial) and not partial_ok:
            raise RuleRejected(f"{call.op} compares values, so a {p!r} input must be reduced first: "
                               f"{unshard_fix(call, p)}", legal)
        else:
            p_out = p
        return Decision(placements, (p_out,) * len(call.outputs))
    return rule


def off_dim(position: int, default: int = 0, why: str = "the pieces would not be shards of the pieces",
            drops: bool = False, legal: str = "S(d) off the op's dim, R, Partial"):
    """out_dim_of for ops that work along one dim (argument `position`/"dim"): that dim must not
    be sharded; with `drops` the op removes it (unbind), so later dims shift down."""
    def out_dim_of(call: Call, dim: int) -> int:
        along = normalize_dim(call.param(position, "dim", default), len(call.inputs[0].shape))
        if dim == along:
            raise RuleRejected(f"{call.op} along sharded dim {dim}: {why}; {unshard_fix(call, Shard(dim))}",
                               legal)
        return dim - 1 if drops and dim > along else dim
    return out_dim_of
