"""The worker's side of a Backward command: torch's own autograd engine over this rank's local
graph. The forward recorded every local op (RunOp with `grad`) and every redistribute step as an
autograd Function whose backward is the dual collective (kernels.DifferentiableStep), so one
engine run per rank computes every local gradient, and the collectives meet in the same order on
every rank: the engine runs nodes in reverse creation order, and every rank created the same
communication nodes in the same order. Data-parallel gradients are all-reduced in buckets while
the engine runs (grad_buckets.py).
"""
from __future__ import annotations

import torch

from .. import protocol as wire
from .grad_buckets import BucketBuffers, BucketReducer
from .kernels import saves_gathered, saving_gathered

__all__ = ["run_backward", "run_recorded", "connect_outputs", "mark_used_in_region", "refuse_used_in_region"]


def run_backward(tensors: dict, roots: list, seeds: list, command: wire.Backward, comm, mesh, rank: int,
                 buffers: BucketBuffers) -> None:
    if command.mode == "grad":
        inputs = [tensors[i] for i in command.inputs]
        refuse_used_in_region(inputs)
        found = torch.autograd.grad(roots, inputs, seeds, retain_graph=command.retain_graph, allow_unused=True)
        for out_id, tensor, grad in zip(command.out_ids, inputs, found):
            tensors[out_id] = _dense(grad, tensor)
        return
    inputs = [tensors[i] for i in command.inputs]
    refuse_used_in_region(inputs)
    for tensor in inputs:   # an intermediate the user retains (x.retain_grad()): torch keeps its .grad
        if tensor.grad_fn is not None:
            tensor.retain_grad()
    with BucketReducer(comm, mesh, rank, inputs, command.buckets, buffers) as reducer:
        torch.autograd.backward(roots, seeds, retain_graph=command.retain_graph)
        reducer.finish()
    for leaf_id, out_id in zip(command.inputs, command.out_ids):
        leaf = tensors[leaf_id]
        if leaf.grad is None or leaf.grad._is_zerotensor():
            leaf.grad = _dense(leaf.grad, leaf)   # not reached here, or torch's lazy zeros (sign's gradient)
        tensors[out_id] = leaf.grad


def mark_used_in_region(tensor: torch.Tensor) -> None:
    """An output of a checkpoint region (checkpoint_regions.py) that the region also read: its
    own gradient is refused (refuse_used_in_region)."""
    tensor._dtorch_used_in_region = True


def refuse_used_in_region(tensors) -> None:
    """A gradient asked of a tensor a checkpointed function made and used again (autograd.grad's
    inputs, retain_grad): its uses are inside the region's one node, so the outer engine never
    reaches it and would return zeros."""
    if any(getattr(t, "_dtorch_used_in_region", False) for t in tensors):
        raise RuntimeError("the gradient of a tensor made inside dtorch.utils.checkpoint's function and used there "
                           "again cannot be computed (its uses run inside the region's recomputation): make it "
                           "outside the checkpointed function, or do not checkpoint that function")


def _dense(grad, like: torch.Tensor) -> torch.Tensor:
    """A gradient the workers can keep and send: zeros for None and for torch's ZeroTensor."""
    return torch.zeros_like(like) if grad is None or grad._is_zerotensor() else grad


class _Connect(torch.autograd.Function):
    """The output as is, joined to the op's inputs with a zero gradient. A kernel whose output on
    some rank does not depend on its inputs (an empty shard, zeros off the rank holding a row)
    would otherwise leave that rank's graph without the nodes before it, and a collective
    recorded there would wait in backward for this rank forever. `passes`: the output's own graph
    gets its gradient too (connect_outputs(every=True): an op where some rank's piece of an input
    is empty, whose kernel may have left that input out, as conv2d's empty-input path does)."""

    @staticmethod
    def forward(ctx, output, passes, *inputs):
        ctx.passes, ctx.inputs = passes, [(t.shape, t.dtype, t.device) for t in inputs]
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        zeros = tuple([torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs])
        return (grad if ctx.passes else None, None) + zeros


def run_recorded(kernel, inputs: list, args, kwargs, regather: bool = True):
    """A local op of a forward that records for backward (grad mode on): `inputs` are its input
    tensors that require grad, which its outputs are joined to. `regather` (RunOp.regather) is
    False where some rank holds an empty piece of an input or output: a gathered parameter is
    then saved whole, and every output is joined to every input."""
    if regather and saves_gathered(inputs):
        with saving_gathered():
            result = kernel(*args, **kwargs)
    else:
        result = kernel(*args, **kwargs)
    if not regather:
        return connect_outputs(result, inputs, every=True)
    if type(result) is torch.Tensor:   # one output: connect_outputs' check, inline
        if result.requires_grad or not result.is_floating_point():
            return result
        return _Connect.apply(result, False, *inputs)
    return connect_outputs(result, inputs)


def connect_outputs(result, inputs: list, every: bool = False):
    """Recorded op's outputs, each floating-point one requiring grad as it does on every other rank
    (`every`: each one joined to every input, its own graph kept)."""
    def connected(output):
        if isinstance(output, torch.Tensor) and output.is_floating_point() and (every or not output.requires_grad):
            return _Connect.apply(output, every, *inputs)
        return output
    if isinstance(result, (tuple, list)):
        return type(result)([connected(r) for r in result]) if type(result) in (tuple, list) else \
            [connected(r) for r in result]
    return connected(result)
