"""The worker's side of a Backward command: torch's own autograd engine over this rank's local
graph. The forward recorded every local op (RunOp with `grad`) and every redistribute step as an
autograd Function whose backward is the dual collective (kernels.DifferentiableStep), so one
engine run per rank computes every local gradient, and the collectives meet in the same order on
every rank: the engine runs nodes in reverse creation order, and every rank created the same
communication nodes in the same order.
"""
from __future__ import annotations

import torch

from . import protocol as wire

__all__ = ["run_backward"]


def run_backward(tensors: dict, roots: list, seeds: list, command: wire.Backward) -> None:
    if command.mode == "grad":
        inputs = [tensors[i] for i in command.inputs]
        found = torch.autograd.grad(roots, inputs, seeds, retain_graph=command.retain_graph, allow_unused=True)
        for out_id, tensor, grad in zip(command.out_ids, inputs, found):
            tensors[out_id] = torch.zeros_like(tensor) if grad is None else grad
        return
    torch.autograd.backward(roots, seeds, retain_graph=command.retain_graph)
    for leaf_id, out_id in zip(command.inputs, command.out_ids):
        leaf = tensors[leaf_id]
        if leaf.grad is None:   # not reached on this rank's graph: its gradient is zero here
            leaf.grad = torch.zeros_like(leaf)
        tensors[out_id] = leaf.grad
