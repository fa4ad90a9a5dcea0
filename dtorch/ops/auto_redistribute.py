"""PURE: the redistributes that make a call legal when its inputs' placements do not line up
(x is S(0) and y is S(1); softmax over a sharded dim; a matmul contracting a dim sharded on one
side only). dispatch.plan_call asks here only when the rules refuse the call as given and strict
mode is off; the answer lands in the cached plan, and op_issue.call_op issues each move as an
ordinary Redistribute command before the op.

The choice is the rules' own: on the mesh dim a rule refuses, the legal combinations are the
ones suggest.legal_combinations finds by asking the rule, and the cheapest by bytes moved
(suggest.move_cost, the same estimate a refusal's "Fix:" quotes) wins. Rules are 1-D, so a choice
on one mesh dim can make another dim's, or the nesting of shards across dims, refuse: the call is
planned again after each choice, a bounded number of rounds. When that does not settle, the
fallbacks are Replicate on the dims that refused, then Replicate everywhere. Every outcome is
checked by the same expansion the strict path runs, so a move never yields a plan the rules
would not accept as given; None means no layout was found and the caller raises the strict error.
"""
from __future__ import annotations

from ..spec.placements import Replicate
from ..spec.redistribute import LOCAL_ONLY, plan_redistribute, step_kind
from .rules import Call, Refusal, Rule, try_expand
from .suggest import cheapest_combination, legal_combinations
from .tensor_meta import tensor_meta

__all__ = ["legal_call", "takes_communication"]

ROUNDS_PER_MESH_DIM = 2   # greedy re-planning rounds before the Replicate fallbacks


def takes_communication(given, wanted) -> bool:
    """Whether turning placements `given` into `wanted` needs a collective (more than a slice)."""
    return any(step_kind(before, after) not in LOCAL_ONLY for _, before, after in plan_redistribute(given, wanted))


def legal_call(rule: Rule, call: Call) -> tuple[Call, tuple] | None:
    """(the call on moved inputs, ((input index, target placements), ...)): no moves when the
    call is legal as given, None when no layout was found."""
    inputs = list(call.inputs)
    refused_dims: set[int] = set()
    for _ in range(ROUNDS_PER_MESH_DIM * call.mesh.ndim + 1):
        outcome = try_expand(rule, call._replace(inputs=tuple(inputs)))
        if type(outcome) is not Refusal:
            wanted = _communicating(inputs, outcome[0])
            if not wanted:
                return _moved(call, inputs)
            # the rule asked for R -> S(d) where it nests under another dim's shard: move there
            inputs = [_placed(spec, wanted[i]) if i in wanted else spec for i, spec in enumerate(inputs)]
            refused_dims.update(range(call.mesh.ndim))
            continue
        refused_dims.add(outcome.mesh_dim)
        now = call._replace(inputs=tuple(inputs))
        legal = legal_combinations(rule, now, outcome.mesh_dim)
        if not legal:
            break
        best = cheapest_combination(now, outcome.mesh_dim, legal)
        inputs = [_placed(spec, _on_dim(spec.placements, outcome.mesh_dim, p)) for spec, p in zip(inputs, best)]
    for dims in (refused_dims, range(call.mesh.ndim)):
        found = _verified(rule, call, [_placed(spec, _replicated(spec.placements, dims)) for spec in call.inputs])
        if found is not None:
            return found
    return None


def _verified(rule: Rule, call: Call, inputs: list):
    outcome = try_expand(rule, call._replace(inputs=tuple(inputs)))
    if type(outcome) is Refusal or _communicating(inputs, outcome[0]):
        return None
    return _moved(call, inputs)


def _communicating(inputs, required) -> dict:
    return {i: wanted for i, (spec, wanted) in enumerate(zip(inputs, required))
            if spec.placements != wanted and takes_communication(spec.placements, wanted)}


def _moved(call: Call, inputs: list) -> tuple[Call, tuple]:
    moves = tuple([(i, new.placements) for i, (old, new) in enumerate(zip(call.inputs, inputs))
                  if old.placements != new.placements])
    return call._replace(inputs=tuple(inputs)), moves


def _placed(spec, placements):
    return tensor_meta(spec.shape, spec.dtype, spec.mesh, placements)


def _on_dim(placements: tuple, mesh_dim: int, placement) -> tuple:
    return placements[:mesh_dim] + (placement,) + placements[mesh_dim + 1:]


def _replicated(placements: tuple, dims) -> tuple:
    return tuple([Replicate() if d in dims else p for d, p in enumerate(placements)])
