"""The floor for a redistribute: the raw Gloo collective that moves the same bytes, run by
plain torch.distributed processes (one per rank) with no runtime in between, on buffers
allocated once.

Each sample is the slowest rank's time per collective, since a redistribute is done only when
every rank is done. A sample is a burst of `burst` collectives between two barriers, divided by
`burst`; each repetition takes one sample of every burst size in turn, so a load that drifts
during the run touches them alike.
"""
from __future__ import annotations

import math

from .local_ranks import run_ranks

__all__ = ["collective_seconds", "square_side"]


def square_side(nbytes: int) -> int:
    """Side of the square float32 matrix of `nbytes` (the benchmark sizes are powers of 4)."""
    return math.isqrt(nbytes // 4)


def collective_seconds(world: int, cases: list[tuple[str, int]], reps: int, timeout_s: float,
                       bursts: tuple = (1,)) -> dict:
    """{(collective, nbytes, burst): [seconds per collective, one per repetition]} measured in
    one process group. Collectives: all_gather, all_reduce, all_to_all, reduce_scatter."""
    per_rank = run_ranks(_measure_all, world, (cases, reps, bursts), timeout_s)
    return per_rank[0]


def _measure_all(rank: int, world: int, cases, reps: int, bursts) -> dict | None:
    import torch
    import torch.distributed as dist
    results = {}
    for collective, nbytes in cases:
        run_once = _collective(collective, square_side(nbytes) ** 2, world)
        for burst in bursts:   # warm-up
            _time_burst(dist, run_once, burst)
        samples = [[_time_burst(dist, run_once, burst) for burst in bursts] for _ in range(reps)]
        local = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        for column, burst in enumerate(bursts):
            results[(collective, nbytes, burst)] = local[:, column].tolist()
    return results if rank == 0 else None


def _time_burst(dist, run_once, burst: int) -> float:
    import time
    dist.barrier()
    start = time.perf_counter()
    for _ in range(burst):
        run_once()
    return (time.perf_counter() - start) / burst


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
    if name == "reduce_scatter":
        full = torch.randn(elements)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, full)
    raise ValueError(f"unknown collective {name!r}")
