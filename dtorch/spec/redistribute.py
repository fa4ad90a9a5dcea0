"""PURE: a placement pair -> the ordered steps that realize it.

A step changes the placement of ONE mesh dim: (mesh_dim, from_code, to_code) in wire codes
(protocol.encode_placement). The worker maps each pair to what it costs:
  S(i) -> R      all-gather (uneven shards padded to the chunk size, then trimmed)
  P    -> R      all-reduce
  P    -> S(i)   reduce-scatter
  S(i) -> S(j)   all-to-all
  R    -> S(i)   local slice, no communication
  R    -> P      local: the coordinate-0 rank keeps the value, the others hold the identity

Order matters when one tensor dim is sharded over several mesh dims (nested sharding: a later
mesh dim splits the chunk an earlier one made). Un-sharding therefore runs inner (last) mesh
dim first, and sharding runs outer (first) mesh dim first.
"""
from __future__ import annotations

from collections.abc import Sequence

from .placements import (Partial, Placement, Replicate, Shard, distinct_shard_ranks, format_placements,
                         local_region)

__all__ = ["plan_redistribute", "plan_transfer", "LOCAL_ONLY", "step_kind", "format_steps"]

R = Replicate()


def step_kind(before: Placement, after: Placement) -> str:
    if isinstance(before, Shard):
        return "all_gather" if after == R else "all_to_all"
    if isinstance(before, Partial):
        return "all_reduce" if after == R else "reduce_scatter"
    return "slice" if isinstance(after, Shard) else "partialize"


LOCAL_ONLY = frozenset({"slice", "partialize"})


def format_steps(placements, steps) -> str:
    """S(0) -> R, one arrow per step: the placements a redistribute goes through."""
    current, shown = list(placements), [format_placements(placements)]
    for mesh_dim, _, after in steps:
        current[mesh_dim] = after
        shown.append(format_placements(current))
    return " -> ".join(shown)


def plan_redistribute(src: Sequence[Placement], dst: Sequence[Placement]) -> list[tuple[int, Placement, Placement]]:
    """Steps (mesh_dim, before, after) turning placements `src` into `dst` on the same mesh."""
    current, dst = list(src), list(dst)
    steps: list[tuple[int, Placement, Placement]] = []

    def move(mesh_dim: int, after: Placement) -> None:
        steps.append((mesh_dim, current[mesh_dim], after))
        current[mesh_dim] = after

    for mesh_dim in reversed(range(len(current))):
        source = current[mesh_dim]
        if isinstance(source, Shard) and _must_unshard(current, dst, mesh_dim):
            target = dst[mesh_dim]
            direct = isinstance(target, Shard) and _alone(current, dst, mesh_dim, source.dim, target.dim)
            move(mesh_dim, target if direct else R)
    for mesh_dim, placement in enumerate(current):
        if isinstance(placement, Partial) and placement != dst[mesh_dim]:
            target = dst[mesh_dim]
            direct = isinstance(target, Shard) and _alone(current, dst, mesh_dim, target.dim)
            move(mesh_dim, target if direct else R)
    for mesh_dim, placement in enumerate(current):
        if placement != dst[mesh_dim]:
            move(mesh_dim, dst[mesh_dim])
    return steps


def _must_unshard(current, dst, mesh_dim: int) -> bool:
    """A shard must go when it changes, or when an outer mesh dim re-splits the same tensor dim
    (then this shard's chunk boundaries move)."""
    if current[mesh_dim] != dst[mesh_dim]:
        return True
    tensor_dim = current[mesh_dim].dim
    return any(current[m] != dst[m] and (current[m] == Shard(tensor_dim) or dst[m] == Shard(tensor_dim))
               for m in range(mesh_dim))


def _alone(current, dst, mesh_dim: int, *tensor_dims: int) -> bool:
    """No other mesh dim shards these tensor dims, now or at the end: a direct collective is safe."""
    return not any(m != mesh_dim and isinstance(p, Shard) and p.dim in tensor_dims
                   for placements in (current, dst) for m, p in enumerate(placements))


def plan_transfer(shape, src_mesh, src_placements, dst_mesh, dst_placements) -> list[tuple]:
    """Moving a tensor between meshes (another pipeline stage, another mesh shape, CPU <-> CUDA):
    (src_rank, dst_rank, offset, box_shape) for every block a destination rank needs from a
    source rank. Placements here hold no Partial (reduce before, re-partialize after).

    Each destination block is cut from one replica of every source shard (coordinate 0 on the
    source's Replicate dims), so every element crosses the network once per receiver."""
    source_blocks = [(r, local_region(shape, src_mesh, src_placements, src_mesh.coordinate_of(r)))
                     for r in distinct_shard_ranks(src_mesh, src_placements)]
    moves = []
    for receiver in dst_mesh.ranks:
        wanted = local_region(shape, dst_mesh, dst_placements, dst_mesh.coordinate_of(receiver))
        for sender, held in source_blocks:
            box = _overlap(held, wanted)
            if box is not None:
                moves.append((sender, receiver) + box)
    return moves


def _overlap(a, b):
    (a_offset, a_shape), (b_offset, b_shape) = a, b
    starts = [max(x, y) for x, y in zip(a_offset, b_offset)]
    ends = [min(x + m, y + n) for x, m, y, n in zip(a_offset, a_shape, b_offset, b_shape)]
    if any(e <= s for s, e in zip(starts, ends)) and starts:
        return None
    return tuple(starts), tuple([e - s for s, e in zip(starts, ends)])
