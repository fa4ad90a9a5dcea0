"""The op chain shared by the dispatch, end-to-end, DTensor and peer benchmarks.

`z = z * 1.0001 + 1` is two elementwise ops; the chain is written once so every system
runs exactly the same Python.
"""
from __future__ import annotations

from .timing import stopwatch

__all__ = ["run_chain", "seconds_per_op", "torch_eager_per_op"]

OPS_PER_LINE = 2


def run_chain(z, ops: int):
    for _ in range(ops // OPS_PER_LINE):
        z = z * 1.0001 + 1
    return z


def seconds_per_op(z, ops: int):
    """(seconds per op spent issuing the chain, the chain's result)."""
    elapsed = stopwatch()
    z = run_chain(z, ops)
    return elapsed() / ops, z


def torch_eager_per_op(shape, ops: int) -> float:
    """The floor: the same chain on a local torch tensor."""
    import torch  # imported here so spawned helpers that never run a chain start fast
    return seconds_per_op(torch.zeros(shape), ops)[0]
