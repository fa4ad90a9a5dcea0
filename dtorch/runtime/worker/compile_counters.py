"""torch's own compile counters on this worker, as numbers a test reads from every rank: did a
`dtorch.compile(fn, backend="inductor")` graph really compile its runs with inductor
(docs/design/compile.md, "Fusing on the workers")?

They are torch's (torch._dynamo.utils.counters), counted since the worker started, so a test
compares two readings: graphs dynamo traced, graphs AOTAutograd compiled, and graphs inductor
compiled or took from its on-disk cache (its FX graph cache counts both; a training forward
compiled through AOTAutograd is two of these, the forward and its backward). A worker that
never fused has not imported the compiler (fusion.py imports it at a graph's first compile) and
reports zeros: reading them costs no import.
"""
from __future__ import annotations

import sys

import torch

from ...ops.registry import kernel

__all__ = ["COMPILE_COUNTERS", "compile_counters"]

COMPILE_COUNTERS = ("dynamo_graphs", "aot_autograd_graphs", "inductor_graphs")
_INDUCTOR_GRAPHS = ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass")


def compile_counters() -> dict:
    """COMPILE_COUNTERS' numbers on this process, each since it started."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return dict.fromkeys(COMPILE_COUNTERS, 0)
    counters = utils.counters
    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            "aot_autograd_graphs": counters["aot_autograd"]["total"],
            "inductor_graphs": sum(counters["inductor"][name] for name in _INDUCTOR_GRAPHS)}


@kernel("compile_counters")
def compile_counters_kernel(device):
    """compile_counters as a tensor in COMPILE_COUNTERS' order: what a test reads from every rank."""
    return torch.tensor(list(compile_counters().values()), dtype=torch.int64, device=device)
