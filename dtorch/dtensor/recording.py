"""What the controller records for backward: grad mode, and one small node per tensor that
requires grad. Only the graph's shape lives here (which tensors came from which, across which
meshes); the values and torch's own autograd graph live on the workers, which record each op
on their local shards when its RunOp says `grad` (docs/design/autograd.md).

A node never holds a DTensor of the user's (so it never keeps a buffer alive), except a
pipeline hop's two ends: those the backward pass must name on the workers.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch

__all__ = ["is_grad_enabled", "set_grad_enabled", "no_grad", "enable_grad", "Leaf", "OpNode", "HopNode",
           "RetainedGrad", "record_op"]

_torch_grad_enabled = torch.is_grad_enabled


class _Mode(threading.local):   # per thread, as in torch: one thread's no_grad is not another's
    enabled = True              # a class default: no thread pays a failed attribute lookup per op


_mode = _Mode()


def is_grad_enabled() -> bool:
    """dtorch's grad mode and torch's: code under `torch.no_grad()` (an evaluation loop,
    torch.nn.init, a hand-written optimizer) records nothing either, as it would in torch."""
    return _mode.enabled and _torch_grad_enabled()


class set_grad_enabled:
    """Like torch.set_grad_enabled: a call that sets the mode, usable as a context manager."""

    def __init__(self, mode: bool):
        # dtorch's own flag, not is_grad_enabled(): under torch.no_grad() that reads False, and
        # restoring it left dtorch's mode off for good once torch's context ended
        self.previous = _mode.enabled
        _mode.enabled = bool(mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _mode.enabled = self.previous


@contextmanager
def no_grad():
    previous = _mode.enabled   # (see set_grad_enabled)
    _mode.enabled = False
    try:
        yield
    finally:
        _mode.enabled = previous


@contextmanager
def enable_grad():
    previous = _mode.enabled
    _mode.enabled = True
    try:
        yield
    finally:
        _mode.enabled = previous


class Leaf:
    """A tensor the user asked gradients for (requires_grad=True, a Parameter). Its gradient
    state lives here: `grad` is the DTensor the workers accumulate into, in its gradient
    placements (autograd/placement_rules.py) until it is read in the tensor's own. `bound`: the id of the
    DTensor the workers' .grad holds; an in-place op on `grad` (`p.grad.mul_(0.5)`) rebinds it to
    a new id here only, so the next backward binds the workers' .grad to it first (autograd/engine.py).
    `hooks`, `post_hooks`: None, or {handle id: hook} (autograd/hooks.py)."""
    __slots__ = ("tensor", "grad", "bound", "hooks", "post_hooks", "__weakref__")

    def __init__(self, tensor):
        self.tensor = weakref.ref(tensor)
        self.grad = self.bound = self.hooks = self.post_hooks = None


class RetainedGrad:
    """An op's output whose gradient the user asked to keep (`x.retain_grad()`): like a Leaf's,
    `grad` is the DTensor the workers accumulate into, in gradient placements until read;
    `bound` as a Leaf's."""
    __slots__ = ("tensor", "grad", "bound")

    def __init__(self, tensor):
        self.tensor = weakref.ref(tensor)
        self.grad = self.bound = None


class OpNode:
    """An op's output that requires grad: the nodes of its inputs that do, and its mesh.
    `retained`: None, or {tensor id: RetainedGrad} for outputs whose gradient is kept."""
    __slots__ = ("inputs", "mesh", "released", "retained", "__weakref__")

    def __init__(self, inputs: tuple, mesh):
        self.inputs, self.mesh, self.released, self.retained = inputs, mesh, False, None


class HopNode:
    """A move to another mesh (a pipeline stage): backward runs on the destination's ranks up to
    `landed`, its gradient moves back, then backward continues from `source` on the source mesh."""
    __slots__ = ("source", "landed", "inputs", "mesh", "released", "__weakref__")

    def __init__(self, source, landed):
        self.source, self.landed = source, landed
        self.inputs, self.mesh, self.released = (source._node,), landed.device_mesh, False


def record_op(nodes: tuple, outputs, mesh) -> None:
    """Give each floating-point output a node (integer outputs carry no gradient, as in torch)."""
    node = OpNode(nodes, mesh)
    for output in outputs:
        if output.dtype.is_floating_point or output.dtype.is_complex:
            output._node = node
