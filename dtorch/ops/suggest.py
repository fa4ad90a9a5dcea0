"""PURE: what to tell a user whose placements an op refuses on one mesh dim: the combinations the
op's own 1-D rule accepts there, in the short notation (S(0)+S(0), R+R, P(sum)+P(sum)), and the
cheapest move that reaches one of them.

Nothing here knows an op: it asks the rule. Each candidate combination (S(d) for each tensor dim,
R, P(sum), per input) is tried on a copy of the call, and the cost of reaching it is the bytes
each rank sends, estimated from the redistribute steps (MOVE_COST). Runs only when a rule
refuses, so it may try a few hundred combinations.
"""
from __future__ import annotations

import itertools
import math
import torch

from ..spec.placements import Partial, Placement, Replicate, Shard, format_placements
from ..spec.redistribute import LOCAL_ONLY, plan_redistribute, step_kind
from .rule_call import Call, Rule

__all__ = ["legal_combinations", "cheapest_combination", "cheapest_fix", "describe_legal", "spell_placements_code",
           "placement_code", "MOVE_COST"]

R = Replicate()

# Fraction of a tensor's bytes (per rank, before this mesh dim) each rank sends per step kind,
# on a mesh dim of n ranks: ring all-gather and reduce-scatter, all-reduce as both, all-to-all
# keeps 1/n of each of its n blocks.
MOVE_COST = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n ** 2,
    "slice": lambda n: 0.0,
    "partialize": lambda n: 0.0,
}
STEP_NAMES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
              "all_to_all": "all-to-all", "slice": "local slice", "partialize": "local partial"}
SHOWN = 8                 # combinations listed in a message, then "…"
FULL_SEARCH_LIMIT = 512   # beyond this many combinations, try uniform ones and one input moved


def candidates(spec) -> list[Placement]:
    """What an input could be on one mesh dim: S(d) for each of its dims, R, P(sum) (not for bool:
    a sum of booleans is not a boolean, and no rule is validated on one). The automatic
    redistribute moves inputs only to these."""
    partial: list[Placement] = [] if spec.dtype == torch.bool else [Partial("sum")]
    shards: list[Placement] = [Shard(d) for d in range(len(spec.shape))]
    return shards + [R] + partial


def legal_combinations(rule: Rule, call: Call, mesh_dim: int) -> list[tuple]:
    """Placement combinations on `mesh_dim` the rule accepts as given (up to free local slicing),
    the simplest first: one placement for every input, then mixed ones."""
    options = [candidates(spec) for spec in call.inputs]
    current = tuple([spec.placements[mesh_dim] for spec in call.inputs])
    legal = [combo for combo in _combinations(options, current) if _accepts(rule, call, mesh_dim, combo)]
    return sorted(legal, key=lambda combo: len(set(combo)))   # stable: candidates' order within


def _combinations(options: list, current: tuple) -> list[tuple]:
    if math.prod(map(len, options)) <= FULL_SEARCH_LIMIT:
        return list(itertools.product(*options))
    uniform = [(p,) * len(options) for p in options[0] if all(p in o for o in options)]
    one_moved = [current[:i] + (p,) + current[i + 1:] for i, o in enumerate(options) for p in o]
    return list(dict.fromkeys(uniform + one_moved))


def _accepts(rule: Rule, call: Call, mesh_dim: int, combo: tuple) -> bool:
    inputs = tuple([spec._replace(placements=spec.placements[:mesh_dim] + (p,) + spec.placements[mesh_dim + 1:])
                   for spec, p in zip(call.inputs, combo)])
    try:
        decision = rule(call._replace(inputs=inputs), combo)
    except Exception:   # any refusal of a hypothetical combination (RuleRejected, ...) means "not legal"
        return False
    return all(given == needed or step_kind(given, needed) in LOCAL_ONLY
               for given, needed in zip(combo, decision.inputs))


def move_cost(spec, mesh_dim: int, target: Placement) -> tuple[float, list[str]]:
    """(bytes each rank sends, step kinds) to turn `spec` into `target` on `mesh_dim`."""
    mesh = spec.mesh
    kinds = [step_kind(before, after) for _, before, after in plan_redistribute([spec.placements[mesh_dim]], [target])]
    split = math.prod(mesh.shape[d] for d, p in enumerate(spec.placements) if d != mesh_dim and isinstance(p, Shard))
    size = math.prod(spec.shape) * spec.dtype.itemsize / split
    return sum(MOVE_COST[kind](mesh.shape[mesh_dim]) for kind in kinds) * size, kinds


def cheapest_combination(call: Call, mesh_dim: int, legal: list[tuple]) -> tuple:
    """The legal combination reached by sending the fewest bytes (fewest inputs moved on a tie):
    the fix a refusal suggests, and the move the automatic redistribute makes."""
    def total(combo):
        moves = [move_cost(spec, mesh_dim, p) for spec, p in zip(call.inputs, combo)]
        return sum(cost for cost, _ in moves), sum(bool(kinds) for _, kinds in moves)
    return min(legal, key=total)


def cheapest_fix(call: Call, mesh_dim: int, legal: list[tuple]) -> str:
    """The cheapest move to a legal combination, spelled as the redistribute the user can paste."""
    best = cheapest_combination(call, mesh_dim, legal)
    moved = [(i, spec, p) for i, (spec, p) in enumerate(zip(call.inputs, best)) if spec.placements[mesh_dim] != p]
    return " and ".join(_spell_move(i, spec, mesh_dim, p) for i, spec, p in moved)


def _spell_move(index: int, spec, mesh_dim: int, target: Placement) -> str:
    placements = spec.placements[:mesh_dim] + (target,) + spec.placements[mesh_dim + 1:]
    cost, kinds = move_cost(spec, mesh_dim, target)
    how = " then ".join(STEP_NAMES[kind] for kind in kinds)
    sent = f" of ≈ {_bytes(cost)} per rank" if cost else ", no communication"
    return (f"move input {index} to {format_placements(placements)} ({how}{sent}): "
            f"input{index}.redistribute(placements={spell_placements_code(placements)})")


def describe_legal(legal: list[tuple]) -> str:
    shown = ", ".join("+".join(map(repr, combo)) for combo in legal[:SHOWN])
    return shown + (f", … ({len(legal) - SHOWN} more)" if len(legal) > SHOWN else "")


def spell_placements_code(placements) -> str:
    """How the user writes placements: [Shard(0), Replicate(), Partial()]."""
    return "[" + ", ".join(map(placement_code, placements)) + "]"


def placement_code(placement: Placement) -> str:
    """How the user writes one placement: Shard(0), Replicate(), Partial(), Partial("avg"), for
    fixes the user can paste."""
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Partial):
        return "Partial()" if placement.reduce_op == "sum" else f'Partial("{placement.reduce_op}")'
    return "Replicate()"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable: the last unit always returns")
