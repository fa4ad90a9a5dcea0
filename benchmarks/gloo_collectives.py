"""The floor for a redistribute: the raw Gloo collective that moves the same bytes, run by
plain torch.distributed processes (one per rank) with no runtime in between.

Each sample is the slowest rank's time for one collective, since a redistribute is done
only when every rank is done.
"""
from __future__ import annotations

import math

from .local_ranks import run_ranks

__all__ = ["COLLECTIVES", "collective_seconds", "square_side"]

# The collective each dtorch transition needs, by the transition's short name.
COLLECTIVES = {"S(0)->R": "all_gather", "P->R": "all_reduce", "S(0)->S(1)": "all_to_all"}


def square_side(nbytes: int) -> int:
    """Side of the square float32 matrix of `nbytes` (the benchmark sizes are powers of 4)."""
    return math.isqrt(nbytes // 4)


def collective_seconds(world: int, cases: list[tuple[str, int]], reps: int, timeout_s: float) -> dict:
    """{(collective, nbytes): [seconds per repetition]} measured in one process group."""
    per_rank = run_ranks(_measure_all, world, (cases, reps), timeout_s)
    return per_rank[0]


def _measure_all(rank: int, world: int, cases, reps: int) -> dict | None:
    import torch
    import torch.distributed as dist
    results = {}
    for collective, nbytes in cases:
        run_once = _collective(collective, square_side(nbytes) ** 2, world)
        local = torch.tensor([_time_one(dist, run_once) for _ in range(reps + 1)][1:], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        results[(collective, nbytes)] = local.tolist()
    return results if rank == 0 else None


def _time_one(dist, run_once) -> float:
    import time
    dist.barrier()
    start = time.perf_counter()
    run_once()
    return time.perf_counter() - start


def _collective(name: str, elements: int, world: int):
    """A no-argument callable that runs one collective on preallocated buffers."""
    import torch
    import torch.distributed as dist
    shard = torch.randn(elements // world)
    if name == "all_gather":
        gathered = torch.empty(elements)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(gathered, shard)
    if name == "all_reduce":
        full = torch.randn(elements)
        return lambda: dist.all_reduce(full)
    if name == "all_to_all":
        received = torch.empty_like(shard)
        return lambda: dist.all_to_all_single(received, shard)
    raise ValueError(f"unknown collective {name!r}")
